"""A host's pool of pre-started replica processes (``[agent] warm_replicas``).

A kernel's start waits for three Python processes to import IPython, ipykernel,
ZeroMQ and nbos: seconds, most of a start (NotebookOS keeps pre-warmed containers
for the same reason). The pool keeps ``size`` processes of
``python -m nbos.kernel.replica --warm`` running: each imported all that and waits
for a :class:`~nbos.core.wire.agent.WarmAssignment` on its stdin. :meth:`WarmPool.take`
hands one out with its assignment and starts a replacement in the background.

With a :class:`~nbos.agent._template.ReplicaTemplate` (``[agent] fork_replicas``) each
is a fork of the template, which imported all that once: the pool's processes and the
replicas they become share those pages. When the template cannot fork, the pool starts
its process from scratch instead.

A pre-started process is started like any replica (own session and process group,
a log file under the agent's ``logs``), so once assigned it is a replica like the
others: the same record, pid and adoption after an agent restart. Until then only
its stdin (a pipe, or a socket for a fork) ties it to the agent: when the agent ends,
however it ends, it closes and the process exits (it was nobody yet).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Mapping, Sequence

import anyio
import anyio.abc
import msgspec

from nbos.agent._template import BROKEN_START_S, ForkedProcess, ReplicaTemplate
from nbos.backends import LocalProcessBackend, LocalProcessHandle
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError
from nbos.core.ids import HostId
from nbos.core.wire.agent import WARM_FLAG, WarmAssignment

log = logging.getLogger(__name__)

#: What a replica's argv starts with (after the interpreter) to be run by a warm process.
REPLICA_MODULE = ("-m", "nbos.kernel.replica")
# Variables Python reads when it starts: a warm process started long before cannot
# take them, so a replica that names one starts cold.
_START_TIME_ENV = ("PYTHON", "LD_")
#: A pre-started process: started from scratch, or forked from the template.
WarmProcess = LocalProcessHandle | ForkedProcess


class WarmPool:
    """Keeps ``size`` pre-started replica processes of ``python`` on ``host``.

    :meth:`fill` starts filling it in ``tg``; ``size`` 0 keeps none and :meth:`take`
    always answers ``None``. ``fork``: its processes are forks of a template.
    """

    def __init__(
        self,
        backend: LocalProcessBackend,
        host: HostId,
        size: int,
        tg: anyio.abc.TaskGroup,
        python: str = sys.executable,
        *,
        fork: bool = False,
    ) -> None:
        self._template = ReplicaTemplate(backend, host, tg, python) if fork and size else None
        self._backend = backend
        self._host = host
        self._size = size
        self._python = python
        self._tg = tg
        self._ready: list[WarmProcess] = []
        self._watching: dict[int, anyio.CancelScope] = {}
        self._starting = 0
        self._seq = itertools.count(1)
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def fill(self) -> None:
        """Start what the pool lacks, in the background."""
        while not self._closed and len(self._ready) + self._starting < self._size:
            self._starting += 1
            self._tg.start_soon(self._start_one)

    def serves(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a warm process can become the replica ``argv`` (already expanded)."""
        return (
            self._size > 0
            and len(argv) > len(REPLICA_MODULE)
            and argv[0] == self._python
            and tuple(argv[1 : 1 + len(REPLICA_MODULE)]) == REPLICA_MODULE
            and not any(name.startswith(_START_TIME_ENV) for name in env)
        )

    async def take(self, argv: Sequence[str], env: Mapping[str, str]) -> WarmProcess | None:
        """A warm process now running as replica ``argv`` with ``env``, or ``None`` when
        none is ready or :meth:`serves` says no (start it cold then)."""
        if not self.serves(argv, env):
            return None
        line = msgspec.json.encode(WarmAssignment(list(argv[1 + len(REPLICA_MODULE) :]), dict(env)))
        while self._ready:
            handle = self._ready.pop(0)
            self._watching.pop(handle.pid).cancel()
            self.fill()
            assert handle.stdin is not None
            try:
                await handle.stdin.send(line + b"\n")
                await handle.stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                # It died since it was last seen alive: reap it, try the next one.
                log.info("warm replica (pid %d) gone before its assignment: %r", handle.pid, exc)
                self._tg.start_soon(handle.wait)
                continue
            return handle
        return None

    async def aclose(self) -> None:
        """Stop refilling and let the waiting processes go (end of file on their stdin)."""
        self._closed = True
        if self._template is not None:
            await self._template.aclose()
        for scope in self._watching.values():
            scope.cancel()
        for handle in self._ready:
            assert handle.stdin is not None
            await handle.stdin.aclose()
        self._ready.clear()

    # --- internals ---------------------------------------------------------------

    async def _start_one(self, delay: float = 0.0) -> None:
        try:
            await anyio.sleep(delay)
            if self._closed:
                return
            label = f"warm-{next(self._seq)}"
            handle: WarmProcess | None = None
            if self._template is not None:
                handle = await self._template.fork(label)
            if handle is None:
                spec = ProcessSpec([self._python, *REPLICA_MODULE, WARM_FLAG], label=label)
                try:
                    handle = await self._backend.start(self._host, spec, stdin_pipe=True)
                except BackendError as exc:
                    log.warning("host %s: cannot pre-start a replica: %s", self._host, exc)
                    return
        finally:
            self._starting -= 1
        if self.closed:  # closed while it started: it is nobody's
            assert handle.stdin is not None
            await handle.stdin.aclose()
            return
        scope = self._watching[handle.pid] = anyio.CancelScope()
        self._ready.append(handle)
        log.debug("host %s: warm replica pid %d (%s)", self._host, handle.pid, handle.log_path)
        self._tg.start_soon(self._watch, handle, scope, time.monotonic())

    async def _watch(self, handle: WarmProcess, scope: anyio.CancelScope, started: float) -> None:
        """Until it is handed out: a warm process that ends leaves the pool, replaced."""
        with scope:
            status = await handle.wait()
        if scope.cancel_called:
            return  # handed out (or the pool closed): its new owner watches it
        self._watching.pop(handle.pid, None)
        self._ready.remove(handle)
        lived = time.monotonic() - started
        log.warning(
            "host %s: warm replica pid %d ended with status %s after %.1f s (log %s)",
            self._host,
            handle.pid,
            status,
            lived,
            handle.log_path,
        )
        if self._closed:
            return
        self._starting += 1
        self._tg.start_soon(self._start_one, BROKEN_START_S if lived < BROKEN_START_S else 0.0)
