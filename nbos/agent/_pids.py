"""Processes known by PID across restarts of whoever started them.

A PID alone may name another process once the first one ended (PID reuse). The
start time of the process (``/proc/PID/stat``, clock ticks since boot) on the same
boot (``boot_id``) names it for good; a pidfd opened and then checked against it
pins it while held.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import msgspec

from nbos.core.errors import BackendError

log = logging.getLogger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class ProcessIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One process, as recorded when it started."""

    pid: int
    start_ticks: int | None
    boot_id: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        return cls(pid, process_start_ticks(pid), read_boot_id())

    def open(self) -> int | None:
        """A pidfd on the process if it is still this one, else ``None`` (it ended)."""
        if self.boot_id != read_boot_id() or self.start_ticks is None:
            return None
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                log.warning("pidfd_open(%d): %s", self.pid, exc)
            return None
        # Checked after the pidfd is open: from here on the PID cannot change owner. A
        # zombie has ended too: its parent (init, for an orphan) has not reaped it yet.
        stat = _stat(self.pid)
        if stat is None or stat[0] == "Z" or int(stat[19]) != self.start_ticks:
            os.close(pidfd)
            return None
        return pidfd


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or ``None`` if it is gone."""
    stat = _stat(pid)
    return None if stat is None else int(stat[19])  # field 22 of proc(5)


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the third (the state) on; ``None`` if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return stat.rpartition(")")[2].split()


def read_boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group ``pid`` leads (gone already: nothing); the
    caller knows the leader is not reaped, so the id names no newer process.
    :class:`BackendError` when not allowed."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise BackendError(f"cannot signal process group {pid}: {exc}") from exc
