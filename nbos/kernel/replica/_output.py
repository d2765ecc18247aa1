"""A cell's own file descriptors 1 and 2, so that its children's output stays its own.

ipykernel points fds 1 and 2 at one pipe for the kernel's whole life and publishes
what arrives there as output of whatever request is current. A process a cell starts
(``subprocess.Popen``, ``os.fork``, ``multiprocessing``) inherits those descriptors,
so what it prints after the cell showed up as output of later cells. While a cell
runs, its fds 1 and 2 are pipes of its own, read by a thread that publishes as output
of that cell; afterwards the kernel's pipes are back, and the cell's pipe lives on only
while a child holds it. A client shows that late output with the cell that started
the child, as it does for a thread the cell started.
"""

from __future__ import annotations

import array
import codecs
import fcntl
import logging
import os
import sys
import termios
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
#: At most this long, after the cell, for its own last output to be read from the pipe.
_DRAIN_S = 2.0


class _Pump:
    """One pipe standing in for fd ``fd``; a thread writes what arrives to ``stream``."""

    def __init__(self, fd: int, stream: Any, header: dict[str, Any]) -> None:
        self._fd = fd
        self._saved = os.dup(fd)
        self._read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._waiting = threading.Event()
        #: Held while the read end is closed, so that :meth:`drained` never looks at
        #: a descriptor number reused meanwhile.
        self._closing = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(stream, header), name=f"nbos-cell-fd{fd}", daemon=True
        )
        self._thread.start()

    def _run(self, stream: Any, header: dict[str, Any]) -> None:
        stream.set_thread_parent(header)
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        try:
            while True:
                self._waiting.set()
                chunk = os.read(self._read, _READ_SIZE)
                self._waiting.clear()
                if not chunk:
                    break
                stream.write(decode(chunk))
            tail = decode(b"", final=True)
            if tail:
                stream.write(tail)
        except (OSError, ValueError) as exc:  # the stream was closed at shutdown
            log.debug("output pipe of fd %d: %s", self._fd, exc)
        finally:
            with self._closing:
                self._waiting.clear()
                os.close(self._read)

    def restore(self) -> None:
        """Give fd back to the kernel; wait until what the cell wrote has been read."""
        os.dup2(self._saved, self._fd)
        os.close(self._saved)
        deadline = time.monotonic() + _DRAIN_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self._drained():
                return
            self._thread.join(0.005)

    def _drained(self) -> bool:
        """Whether the thread waits for more with nothing left to read (a child may hold
        the pipe open for good, so there need not be an end of file)."""
        with self._closing:
            if not self._waiting.is_set():
                return False
            count = array.array("i", [0])
            fcntl.ioctl(self._read, termios.FIONREAD, count)
            return count[0] == 0


class CellOutput:
    """Fds 1 and 2 of the cell running now (see the module doc); a context manager.

    Does nothing where ``sys.stdout``/``sys.stderr`` are not ipykernel's streams.
    """

    def __init__(self) -> None:
        self._pumps: list[_Pump] = []

    def __enter__(self) -> CellOutput:
        streams: tuple[tuple[int, Any], ...] = ((1, sys.stdout), (2, sys.stderr))
        for fd, stream in streams:
            if hasattr(stream, "set_thread_parent"):
                stream.flush()
                self._pumps.append(_Pump(fd, stream, dict(stream.parent_header)))
        return self

    def __exit__(self, *exc: object) -> None:
        for pump in self._pumps:
            pump.restore()
        self._pumps.clear()
