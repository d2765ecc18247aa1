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

import codecs
import logging
import os
import select
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ipykernel.iostream import OutStream

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
#: At most this many characters of stdout or stderr in one ``stream`` message. ipykernel
#: sends what a cell printed in 0.2 s as one message, tens of MiB in a flood, and each
#: process on its way to a client holds a few copies of a message while it passes: the
#: gateway's memory in flight is counted in messages (ZeroMQ's queues) and copies of one.
STREAM_MESSAGE_CHARS = 1 << 20


class _Pump:
    """One pipe standing in for fd ``fd`` while a cell runs; its output goes to ``stream``
    as output of the cell with header ``header``.

    The process's one reader thread (:class:`_Reader`) and :meth:`restore` both read
    the pipe, one at a time (``lock``), so the cell's last output is published in
    order, before the cell's reply, without waiting for the thread: a child may hold
    the pipe open for as long as it lives.
    """

    def __init__(self, fd: int, stream: Any, header: dict[str, Any], reader: _Reader) -> None:
        self._fd = fd
        self._stream = stream
        self._header = header
        self._reader = reader
        self._saved = os.dup(fd)
        self.read, write = os.pipe()
        os.set_blocking(self.read, False)
        os.dup2(write, fd)
        os.close(write)
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self.lock = threading.Lock()
        #: Every writer closed the pipe and all it held was published.
        self.ended = False
        reader.watch(self)

    def pump(self) -> None:
        """Publish what the pipe holds now; the caller holds ``lock``."""
        token = self._stream.set_thread_parent(self._header)
        try:
            while not self.ended:
                try:
                    chunk = os.read(self.read, _READ_SIZE)
                except BlockingIOError:
                    return
                text = self._decode(chunk, final=not chunk)
                if text:
                    self._stream.write(text)
                self.ended = not chunk
        finally:
            self._stream.reset_thread_parent(token)

    def restore(self) -> None:
        """Give the fd back to the kernel and publish what the cell wrote there.

        The reader thread stops watching the pipe first: unless a child holds it, giving
        the fd back ends it, and the thread need not wake (and take the GIL) for that.
        """
        with self.lock:
            self._reader.unwatch(self)
            os.dup2(self._saved, self._fd)
            os.close(self._saved)
            self.pump()
            if self.ended:
                os.close(self.read)
            else:
                self._reader.watch(self)


class _Reader:
    """The thread that publishes what arrives on cells' pipes, one for the process.

    It waits in ``epoll``, whose interest list other threads change without waking it:
    a cell that prints nothing on its fds costs the thread nothing.
    """

    def __init__(self) -> None:
        self._pumps: dict[int, _Pump] = {}
        self._guard = threading.Lock()
        self._epoll = select.epoll()
        threading.Thread(target=self._run, name="nbos-cell-output", daemon=True).start()

    def watch(self, pump: _Pump) -> None:
        with self._guard:
            self._pumps[pump.read] = pump
            self._epoll.register(pump.read, select.EPOLLIN)

    def unwatch(self, pump: _Pump) -> None:
        # Before its fd closes: a forked child holding the pipe would keep it in the
        # interest list after the close, under a number that a later pipe may reuse.
        with self._guard:
            if self._pumps.get(pump.read) is pump:
                del self._pumps[pump.read]
                self._epoll.unregister(pump.read)

    def _run(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():
                with self._guard:
                    pump = self._pumps.get(fd)
                if pump is not None:
                    self._serve(pump)

    def _serve(self, pump: _Pump) -> None:
        with pump.lock:
            if self._pumps.get(pump.read) is not pump:
                return  # restored (and maybe closed) since the thread saw it ready
            try:
                pump.pump()
            except (OSError, ValueError) as exc:  # the stream was closed at shutdown
                log.debug("cell output pipe %d: %s", pump.read, exc)
                pump.ended = True
            if pump.ended:
                self.unwatch(pump)
                os.close(pump.read)


_reader: _Reader | None = None


def _the_reader() -> _Reader:
    global _reader  # noqa: PLW0603 - one reader thread per process, started on first use
    if _reader is None:
        _reader = _Reader()
    return _reader


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
                pump = _Pump(fd, stream, dict(stream.parent_header), _the_reader())
                self._pumps.append(pump)
        return self

    def __exit__(self, *exc: object) -> None:
        for pump in self._pumps:
            pump.restore()
        self._pumps.clear()


class ReplicaOutStream(OutStream):
    """ipykernel's ``sys.stdout`` and ``sys.stderr``, whose flush returns at once when
    nothing was written since the last one, and which send what was written in messages
    of at most :data:`STREAM_MESSAGE_CHARS` characters.

    ipykernel flushes both before every reply, each a round trip to its IO thread: on
    a loaded host, a wait for the GIL behind the Raft thread, on every cell. With nothing
    buffered there is nothing to send: what the cell published otherwise (display data,
    its result) is queued on that thread already, ahead of the cell's idle, and the
    front holds the client's idle until the replica's.
    """

    def flush(self) -> None:
        with self._buffer_lock:
            written = bool(self._buffers)
        if written:
            super().flush()  # type: ignore[no-untyped-call]

    def _flush_buffers(self) -> Iterator[tuple[dict[str, Any], str]]:
        for parent, text in super()._flush_buffers():  # type: ignore[no-untyped-call]
            for start in range(0, len(text), STREAM_MESSAGE_CHARS):
                yield parent, text[start : start + STREAM_MESSAGE_CHARS]
