"""A gateway's runtime file: where a background gateway tells its clients its address.

``nbos gateway --runtime-file PATH`` writes ``{"pid": ..., "address": ...}`` to
``PATH`` (atomically) once its control endpoint is bound, and removes it when it
exits. ``PATH.lock`` serialises the clients that start a gateway when none
answers (so two starting at once start one) against the gateway's own exit when
idle (so none is told an address that is going away).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

log = logging.getLogger(__name__)


@attrs.frozen
class Announcement:
    pid: int
    address: str


@attrs.frozen
class RuntimeFile:
    path: Path

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def locked(self, *, block: bool = True) -> Iterator[bool]:
        """Hold ``PATH.lock``; yields ``False`` (and holds nothing) if ``block`` is
        false and another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def read(self) -> Announcement | None:
        """What the file says; ``None`` if it is absent or unreadable."""
        try:
            data = json.loads(self.path.read_text())
            return Announcement(int(data["pid"]), str(data["address"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, address: str) -> None:
        """Announce this process's gateway at ``address``."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "address": address}, f)
        os.replace(tmp, self.path)

    def remove_if_mine(self) -> None:
        """Remove the file if it announces this process (a newer gateway may own it)."""
        found = self.read()
        if found is not None and found.pid == os.getpid():
            self.path.unlink(missing_ok=True)
            log.info("gateway: removed %s", self.path)
