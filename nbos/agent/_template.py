"""A host's replica template: the process pre-started replicas are forked from.

With ``[agent] fork_replicas`` (the default where there is a pool) the agent keeps one
``python -m nbos.kernel.replica --template`` process (:mod:`nbos.kernel.replica._template`):
it imported everything once, and each pre-started replica is a fork of it, sharing those
pages instead of holding a copy of its own. The template is started like any process
of the agent (its backend: own session, log file under ``STATE/logs``); each fork gets a
session of its own, the stdin the pool assigns it through and a log file of its own,
and runs on as the pre-started replica a cold start would have made.

A forked process is the template's child, not the agent's: :class:`ForkedProcess` holds
it through the pidfd the template sent (its identity, whatever happens to its PID) and
hears its exit status from the template, which reaps it. When the template ends, its
forks go on (reparented; their exit status is then unknown) and the next fork starts
another template; one that ended within :data:`BROKEN_START_S` of its start waits that
long first. Meanwhile :meth:`ReplicaTemplate.fork` answers ``None``, and the pool starts
its process from scratch: a template's trouble never fails a start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import time
from pathlib import Path

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from nbos.agent._pids import signal_group
from nbos.backends import LocalProcessBackend, LocalProcessHandle
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError
from nbos.core.ids import HostId
from nbos.core.wire.agent import (
    FORK_REQUEST,
    TEMPLATE_FLAG,
    TemplateExited,
    TemplateForked,
    TemplateReport,
)

log = logging.getLogger(__name__)

#: What a template's argv starts with (after the interpreter).
TEMPLATE_MODULE = ("-m", "nbos.kernel.replica", TEMPLATE_FLAG)
#: A template (or pre-started process) that ended sooner than this after its start is a
#: broken setup, not bad luck: the next one waits this long.
BROKEN_START_S = 10.0
# How long a fork may take once the template runs (its imports come first: minutes on
# a loaded host are not unheard of).
_FORK_TIMEOUT_S = 300.0
_MAX_REPORT = 4096


class ForkedProcess:
    """A process the template forked: its pid, its log, the write end of its stdin."""

    def __init__(self, host: HostId, pid: int, pidfd: int, log_path: Path) -> None:
        self.host = host
        self.pid = pid
        self.log_path = log_path
        #: Where its assignment goes (set once the fork is handed out).
        self.stdin: anyio.abc.ByteSendStream | None = None
        self._pidfd = pidfd
        self._ended = anyio.Event()
        #: Its exit status once it ended (``-N``: signal ``N``); ``None`` before, and
        #: after too when the template was gone by then (nobody reaped it for us).
        self.returncode: int | None = None

    def __repr__(self) -> str:
        return f"<ForkedProcess host={self.host} pid={self.pid} rc={self.returncode}>"

    def running(self) -> bool:
        return not self._ended.is_set()

    async def wait(self) -> int | None:
        """Its exit status once it ended; ``None`` where that is unknown."""
        await self._ended.wait()
        return self.returncode

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to its process group; nothing once it ended."""
        if self._ended.is_set() or _readable(self._pidfd):
            return
        # Not ended (its pidfd is not readable): the group id is still its own.
        signal_group(self.pid, signum)

    def end(self, returncode: int | None) -> None:
        if self._ended.is_set():
            return
        self.returncode = returncode
        os.close(self._pidfd)
        self._ended.set()

    async def wait_unreaped(self) -> None:
        """Its template is gone: its end shows on its pidfd, with no status."""
        if not self._ended.is_set():
            await anyio.wait_readable(self._pidfd)
            self.end(None)


class ReplicaTemplate:
    """The template process of ``host``'s pre-started replicas (started on first use)."""

    def __init__(
        self,
        backend: LocalProcessBackend,
        host: HostId,
        tg: anyio.abc.TaskGroup,
        python: str = sys.executable,
    ) -> None:
        self._backend = backend
        self._host = host
        self._tg = tg
        self._python = python
        self._control: socket.socket | None = None
        self._lock = anyio.Lock()
        # The fork asked for (its log), and where the template's answer goes.
        self._pending: Path | None = None
        self._answer: MemoryObjectSendStream[ForkedProcess | None] | None = None
        self._forked: dict[int, ForkedProcess] = {}
        self._not_before = 0.0
        self._closed = False

    async def fork(self, label: str) -> ForkedProcess | None:
        """A new pre-started process, forked; ``None`` when no template can fork now."""
        async with self._lock:
            if self._control is None and not await self._start():
                return None
            return await self._fork(label)

    async def aclose(self) -> None:
        """Let the template go (its end of the socket closes and it exits); its forks stay."""
        self._closed = True
        if self._control is not None:
            anyio.notify_closing(self._control)  # its listener's wait ends
            self._control.close()
            self._control = None

    # --- internals ---------------------------------------------------------------

    async def _start(self) -> bool:
        if self._closed or time.monotonic() < self._not_before:
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            spec = ProcessSpec([self._python, *TEMPLATE_MODULE], label="template")
            process = await self._backend.start(self._host, spec, stdin_fd=theirs.fileno())
        except BackendError as exc:
            log.warning("host %s: no replica template: %s", self._host, exc)
            ours.close()
            self._not_before = time.monotonic() + BROKEN_START_S
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._control = ours
        log.info("host %s: replica template pid %d (%s)", self._host, process.pid, process.log_path)
        self._tg.start_soon(self._listen, ours, process, time.monotonic())
        return True

    async def _fork(self, label: str) -> ForkedProcess | None:
        control = self._control
        assert control is not None
        try:
            spec = ProcessSpec([self._python, *TEMPLATE_MODULE], label=label)
            log_path, log_file = await self._backend.open_log(self._host, spec)
        except BackendError:
            return None
        ours, theirs = socket.socketpair()
        send, receive = anyio.create_memory_object_stream[ForkedProcess | None](1)
        self._pending, self._answer = log_path, send
        try:
            with log_file, theirs:
                try:
                    socket.send_fds(control, [FORK_REQUEST], [theirs.fileno(), log_file.fileno()])
                except OSError as exc:
                    log.warning("host %s: replica template unreachable: %s", self._host, exc)
                    ours.close()
                    return None
            forked: ForkedProcess | None = None
            with anyio.move_on_after(_FORK_TIMEOUT_S):
                forked = await receive.receive()
        finally:
            self._pending = self._answer = None
            send.close()
            receive.close()
        if forked is None:
            ours.close()
            return None
        forked.stdin = await anyio.abc.UNIXSocketStream.from_socket(ours)
        return forked

    async def _listen(
        self, control: socket.socket, process: LocalProcessHandle, started: float
    ) -> None:
        """Read the template's reports until it ends; then its forks go on without it."""
        try:
            while True:
                await anyio.wait_readable(control)
                try:
                    data, fds, _, _ = socket.recv_fds(
                        control, _MAX_REPORT, 1, socket.MSG_CMSG_CLOEXEC
                    )
                except BlockingIOError:
                    continue
                if not data:
                    break
                self._take(msgspec.json.decode(data, type=TemplateReport), fds)
        except (OSError, anyio.ClosedResourceError, msgspec.DecodeError) as exc:
            if not self._closed:
                log.warning("host %s: replica template: %r", self._host, exc)
        finally:
            await self._lost(control, process, started)

    def _take(self, report: TemplateReport, fds: list[int]) -> None:
        if isinstance(report, TemplateForked) and fds and self._pending is not None:
            # Known before the next report is read, which may be its end already.
            forked = self._forked[report.pid] = ForkedProcess(
                self._host, report.pid, fds.pop(0), self._pending
            )
            if self._answer is not None:
                self._answer.send_nowait(forked)
        for fd in fds:
            os.close(fd)
        if isinstance(report, TemplateExited) and (ended := self._forked.pop(report.pid, None)):
            ended.end(report.returncode)

    async def _lost(
        self, control: socket.socket, process: LocalProcessHandle, started: float
    ) -> None:
        if self._control is control:
            self._control = None
        control.close()
        if self._answer is not None:
            with contextlib.suppress(anyio.WouldBlock):  # its answer came before the end
                self._answer.send_nowait(None)
        orphans, self._forked = self._forked, {}
        for forked in orphans.values():
            self._tg.start_soon(forked.wait_unreaped)
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            status = await process.wait()
        lived = time.monotonic() - started
        if lived < BROKEN_START_S:
            self._not_before = time.monotonic() + BROKEN_START_S
        log.warning(
            "host %s: replica template pid %d ended with status %d after %.1f s (log %s)%s",
            self._host,
            process.pid,
            status,
            lived,
            process.log_path,
            "; its pre-started replicas start from scratch for a while"
            if lived < BROKEN_START_S
            else "",
        )


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])
