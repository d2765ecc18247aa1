"""The embedded default backend: virtual hosts, each process a local subprocess.

A host is only a name here: every process runs on this machine, in its own
session and process group (so a signal reaches the whole replica, children
included), with ``NBOS_HOST_ID`` naming its virtual host. When a process ends,
whatever is left of its group (processes its cells started) is killed: nothing
outlives the replica that started it. Output goes to one log
file per process under ``run_dir/<host>/`` instead of pipes that could fill up.
Uses only anyio APIs (tested on asyncio).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import BinaryIO

import anyio
import anyio.abc

from nbos.backends._common import (
    HandleBase,
    check_start,
    log_name,
    process_env,
    safe_file_part,
    with_running,
)
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError, ConfigError
from nbos.core.ids import HostId
from nbos.core.private_files import open_private, private_dir

logger = logging.getLogger(__name__)

# How long aclose waits for SIGKILLed processes to be reaped before giving up on them.
_REAP_TIMEOUT = 5.0
#: How much of a failed process's output its warning quotes: its traceback, usually.
_FAILURE_TAIL_BYTES = 4096


class LocalProcessHandle(HandleBase):
    """A local subprocess, the leader of its own process group."""

    def __init__(
        self, host: HostId, process: anyio.abc.Process, log_path: Path, label: str = ""
    ) -> None:
        super().__init__(host)
        self._process = process
        self.log_path = log_path
        self._label = label or str(log_path.name)
        self._failure_told = False
        #: The process id, which is also its process group id.
        self.pid = process.pid
        #: The write end of its stdin, when it was started with ``stdin_pipe``.
        self.stdin = process.stdin
        self._group_ended = False

    def __repr__(self) -> str:
        return f"<LocalProcessHandle host={self._host} pid={self.pid} rc={self.returncode}>"

    @property
    def returncode(self) -> int | None:
        """Exit status; ``-N`` when killed by signal ``N``."""
        return self._process.returncode

    async def wait(self) -> int:
        status = await self._process.wait()
        self._end_group()
        if status > 0 and not self._failure_told:
            self._failure_told = True
            await self._tell_failure(status)
        return status

    async def _tell_failure(self, status: int) -> None:
        """Warn that the process failed, quoting the end of its output (its log may not
        outlive the run: a cluster's run directory goes with it)."""
        try:
            tail = await anyio.to_thread.run_sync(_read_tail, self.log_path, _FAILURE_TAIL_BYTES)
        except OSError as exc:
            tail = f"(its log {self.log_path} is unreadable: {exc})"
        logger.warning(
            "process %s (pid %d) on %s failed with exit code %d%s",
            self._label,
            self.pid,
            self._host,
            status,
            f"; the end of its output:\n{tail}" if tail else "",
        )

    def _end_group(self) -> None:
        """SIGKILL what is left of the process group once its leader ended, once.

        Right after the leader is reaped its group id cannot belong to anyone else:
        Linux does not reuse a number while a process group holds it.
        """
        if self._group_ended:
            return
        self._group_ended = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # nothing was left
        except PermissionError as exc:
            logger.warning("cannot end process group %d on %s: %s", self.pid, self._host, exc)
            return
        logger.info("ended what was left of process group %d on %s", self.pid, self._host)

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group; a no-op once the process ended."""
        if self.returncode is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass  # it ended between the check and the kill
        except PermissionError as exc:
            logger.warning("cannot signal process group %d on %s: %s", self.pid, self._host, exc)
            raise BackendError(f"cannot signal process group {self.pid}: {exc}") from exc


class LocalProcessBackend:
    """Runs every "host" on this machine as local subprocesses.

    ``hosts`` names the virtual hosts. ``run_dir`` holds the log files (a fresh
    temporary directory when not given; see :attr:`run_dir`).
    """

    def __init__(
        self, hosts: Sequence[str], *, run_dir: str | os.PathLike[str] | None = None
    ) -> None:
        if isinstance(hosts, str) or not hosts or len(set(hosts)) != len(hosts):
            raise ConfigError("hosts", hosts, "a non-empty sequence of distinct host names")
        self._hosts = tuple(HostId(h) for h in hosts)
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._handles: list[LocalProcessHandle] = []
        self._seq = itertools.count()
        self._closed = False

    @property
    def name(self) -> str:
        return "local"

    @property
    def run_dir(self) -> Path | None:
        """Where the logs go; ``None`` until the first start when no ``run_dir`` was given."""
        return self._run_dir

    def hosts(self) -> Sequence[HostId]:
        return self._hosts

    async def start(
        self,
        host: HostId,
        spec: ProcessSpec,
        *,
        stdin_pipe: bool = False,
        stdin_fd: int | None = None,
    ) -> LocalProcessHandle:
        """Start ``spec`` on ``host``; ``stdin_pipe``: its stdin is a pipe whose write end
        is the handle's ``stdin``; ``stdin_fd``: its stdin is that descriptor (a socket);
        else ``/dev/null``."""
        check_start(self.name, self._closed, host, self._hosts, spec)
        log_path, log = await self.open_log(host, spec)
        stdin = subprocess.PIPE if stdin_pipe else subprocess.DEVNULL
        try:
            process = await self._spawn(host, spec, log, stdin if stdin_fd is None else stdin_fd)
        finally:
            # The child holds its own copy of the descriptor.
            log.close()
        handle = LocalProcessHandle(host, process, log_path, spec.label)
        self._handles = with_running(self._handles, handle)
        logger.debug("started %r on %s: pid %d, log %s", spec.label, host, handle.pid, log_path)
        return handle

    async def aclose(self) -> None:
        """SIGKILL the process group of every process still running, and reap them."""
        self._closed = True
        live = [h for h in self._handles if h.returncode is None]
        for handle in live:
            await handle.signal(signal.SIGKILL)
        with anyio.move_on_after(_REAP_TIMEOUT):
            for handle in live:
                await handle.wait()
        stuck = [h.pid for h in live if h.returncode is None]
        if stuck:
            logger.error("processes %s survived SIGKILL for %.0fs", stuck, _REAP_TIMEOUT)
        self._handles.clear()

    async def _spawn(
        self, host: HostId, spec: ProcessSpec, log: BinaryIO, stdin: int
    ) -> anyio.abc.Process:
        env = {**os.environ, **process_env(host, spec.env)}
        try:
            return await anyio.open_process(
                list(spec.argv),
                stdin=stdin,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            logger.warning("cannot start %r on %s: %s", spec.argv[0], host, exc)
            raise BackendError(f"cannot start {spec.argv[0]!r} on {host}: {exc}") from exc

    async def open_log(self, host: HostId, spec: ProcessSpec) -> tuple[Path, BinaryIO]:
        """A new log file for ``spec`` on ``host`` (private), for a process started by other
        means than :meth:`start` (a fork of a replica template)."""
        try:
            if self._run_dir is None:
                self._run_dir = Path(
                    await anyio.to_thread.run_sync(partial(tempfile.mkdtemp, prefix="nbos-run-"))
                )
            path = self._run_dir / safe_file_part(host) / log_name(next(self._seq), spec)
            await anyio.to_thread.run_sync(private_dir, path.parent)
            return path, await anyio.to_thread.run_sync(open_private, path)
        except OSError as exc:
            logger.warning("cannot create a log file under %s: %s", self._run_dir, exc)
            raise BackendError(f"cannot create a log file under {self._run_dir}: {exc}") from exc


def _read_tail(path: Path, size: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read().decode(errors="replace").rstrip()
