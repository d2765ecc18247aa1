"""A replicated kernel as the embedding API shows it: execute, kill a replica, shut down."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.abc
import attrs
from jupyter_client.connect import KernelConnectionInfo

from nbos.core.compute_backend import ProcessHandle
from nbos.core.errors import KernelError, NbosError, ReplacementError
from nbos.core.ids import HostId, KernelId
from nbos.gateway._kernel_state import KernelFacts, KernelState, kernel_state, refusal
from nbos.gateway._replacement import Replacer
from nbos.kernel.client import CellClient, ExecuteResult
from nbos.kernel.front import KernelFront

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0
_EXIT_GRACE_S = 1.0


@attrs.frozen
class ReplicaInfo:
    """One replica process of a kernel."""

    node: int
    host: HostId
    pid: int | None
    alive: bool


class Kernel:
    """A running replicated kernel: its front and its replica processes.

    Made by :meth:`nbos.cluster.LocalCluster.start_kernel`. ``connection_info`` is
    what any Jupyter client needs to use the kernel.
    """

    def __init__(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        processes: dict[int, ProcessHandle],
        scope: anyio.CancelScope,
        restart: Callable[[int], Awaitable[ProcessHandle]] | None = None,
        *,
        replacer: Replacer | None = None,
        retire: Callable[[], Awaitable[None]] | None = None,
        owner: str = "",
        gpus: int = 0,
        heals: bool = False,
    ) -> None:
        # ``processes`` is shared with the cluster, which stops what it holds at the end.
        # ``retire`` records the shutdown before anything stops (the gateway's state).
        self.kernel_id = kernel_id
        self.front = front
        #: The user the kernel belongs to (``""``: the admins' only).
        self.owner = owner
        #: The GPUs each of its cells asks for unless the cell says otherwise.
        self.gpus = gpus
        #: When this gateway started the kernel (or took it back), wall-clock seconds.
        self.started_at = time.time()
        self._processes = processes
        self._scope = scope
        self._restart = restart
        # Whether a lost majority is restarted in place (a durable cluster that replaces).
        self._heals = heals and restart is not None
        self._replacer = replacer
        self._retire = retire
        self._retired = False
        self._cells: CellClient | None = None
        self._let_go = False
        self._recoveries = 0
        self._restarting: dict[int, anyio.Event] = {}
        self.closed = anyio.Event()
        #: Whether the kernel lost its majority and its dead replicas are being restarted
        #: in place from their disks.
        self.recovering = False
        #: Why the kernel cannot come back (a majority's disks lost their Raft state);
        #: ``None`` while it can.
        self.lost: str | None = None
        # A request the front cannot serve is told whether the kernel is dead or recovering.
        front.unavailable = lambda account: refusal(kernel_id, self.facts, account)

    @property
    def connection_info(self) -> KernelConnectionInfo:
        return self.front.connection_info

    @property
    def facts(self) -> KernelFacts:
        """What the gateway knows of the kernel now (what its :attr:`state` is made of)."""
        front = self.front
        voters = front.voters
        alive = set(front.alive)
        return KernelFacts(
            members=len(voters),
            alive=sum(node in alive for node in voters),
            unanswering=sum(node not in alive and not self._exited(node) for node in voters),
            cell=front.cell,
            started=front.started,
            recovering=self._recoveries > 0 or self.recovering or self._recovery_due(),
            replacing=self._replacer is not None and self._replacer.recovering,
            closed=self.closed.is_set() or front.is_closing,
        )

    @property
    def state(self) -> KernelState:
        """The kernel's state (:mod:`nbos.gateway._kernel_state`)."""
        return kernel_state(self.facts)

    @contextmanager
    def recovery(self) -> Iterator[None]:
        """The kernel is ``recovering`` while the block runs: a replica is brought back
        (restarted in place, restored from its disk)."""
        self._recoveries += 1
        try:
            yield
        finally:
            self._recoveries -= 1

    def _recovery_due(self) -> bool:
        """Whether the kernel lost its majority and will restart its dead in place: the
        exits are known to the front a moment before the cluster's watch of them sets
        :attr:`recovering`, and meanwhile the kernel must not read ``dead``."""
        front = self.front
        return self._heals and self.lost is None and not (front.is_closing or front.has_quorum)

    def _exited(self, node: int) -> bool:
        """Whether replica ``node``'s process is known to have ended (or is gone)."""
        handle = self._processes.get(node)
        return handle is None or handle.returncode is not None

    @property
    def replicas(self) -> tuple[ReplicaInfo, ...]:
        alive = set(self.front.alive)
        return tuple(
            ReplicaInfo(node, h.host, getattr(h, "pid", None), node in alive)
            for node, h in sorted(self._processes.items())
        )

    @property
    def joining(self) -> tuple[int, HostId] | None:
        """The replica joining the kernel now (a Raft learner catching up), and its host."""
        return self._replacer.joining if self._replacer is not None else None

    @property
    def replacement_failures(self) -> Mapping[int, ReplacementError]:
        """Dead replicas the cluster gave up replacing, after its retries, with why."""
        if self._replacer is None:
            return {}
        alive = set(self.front.alive)
        return {
            node: error
            for node, error in self._replacer.failures.items()
            if node in self._processes and node not in alive
        }

    async def execute(
        self,
        code: str,
        *,
        timeout: float = 600.0,
        metadata: Mapping[str, Any] | None = None,
    ) -> ExecuteResult:
        """Run ``code`` as one cell through the front, like any Jupyter client would.

        ``metadata`` goes into the ``execute_request`` (e.g. ``{"nbos": {"gpus": 2}}``).
        Raises :class:`KernelError` once the kernel is shut down, ``TimeoutError``
        after ``timeout`` seconds.
        """
        if self.closed.is_set():
            raise KernelError(f"kernel {self.kernel_id} is shut down")
        if self._let_go:
            raise KernelError(f"kernel {self.kernel_id} is no longer run by this gateway")
        if self._cells is None:
            self._cells = CellClient(self.connection_info)
        return await self._cells.execute(code, timeout=timeout, metadata=metadata)

    async def digests(self, *, after: int | None = None, timeout: float = 30.0) -> dict[int, str]:
        """Each live replica's namespace digest once it applied cell ``after`` (default: the last).

        Replicas that applied the same cells have equal digests.
        """
        if after is None:
            after = self.front.last_exec_index
        out: dict[int, str] = {}
        for node in self.front.alive:
            reply = await self.front.control_request(
                node, "nbos_digest_request", {"after": after}, timeout=timeout
            )
            if reply is not None and reply["content"].get("status") == "ok":
                out[node] = str(reply["content"]["digest"])
        return out

    async def kill_replica(self, node: int, signum: int = signal.SIGKILL) -> None:
        """Kill replica ``node``'s process (SIGKILL by default) and wait until it is gone."""
        await self.signal_replica(node, signum)
        await self.wait_replica(node)
        self.front.mark_dead(node, f"killed with signal {signum}")

    async def signal_replica(self, node: int, signum: int) -> None:
        """Send ``signum`` to replica ``node``'s process (SIGSTOP, SIGCONT, ...)."""
        await self._process(node).signal(signum)

    async def wait_replica(self, node: int) -> int:
        """Wait until replica ``node``'s process ended; its exit status."""
        return await self._process(node).wait()

    async def restart_replica(self, node: int, *, timeout: float = 60.0) -> None:
        """Start dead replica ``node`` again on its host; returns once it answers.

        It recovers from its own durable Raft log and catches up from the others (a
        snapshot if they compacted past it), so only a durable cluster can do this:
        a replica that forgot its log could break Raft's promises.
        """
        if self._restart is None:
            raise KernelError("replicas can be restarted only on a durable cluster")
        if self._replacer is not None and self._replacer.replacing(node):
            raise KernelError(f"replica {node} of kernel {self.kernel_id} is being replaced")
        underway = self._restarting.get(node)
        if underway is not None:
            # Two restarts at once would start two processes on one Raft log: the second
            # caller (the kernel's own recovery, an operator, a chaos heal) shares the first.
            with anyio.fail_after(timeout):
                await underway.wait()
            if node not in self.front.alive:
                raise KernelError(f"replica {node} of kernel {self.kernel_id} did not come back")
            return
        if self._process(node).returncode is None:
            raise KernelError(f"replica {node} of kernel {self.kernel_id} is still running")
        done = self._restarting[node] = anyio.Event()
        try:
            with self.recovery():
                await self._restart(node)  # which puts the new process in the kernel's processes
                await self.front.revive(node, timeout=timeout)
        finally:
            del self._restarting[node]
            done.set()

    async def replace_replica(
        self, node: int, *, timeout: float = 60.0, target: HostId | None = None
    ) -> int:
        """Replace replica ``node`` by a new one on another host; the new node id.

        ``target`` is that host (it must hold no live replica of the kernel); by
        default the placement policy picks it.

        ``node`` is killed first if it still runs. The new replica joins the kernel's
        Raft group as a learner, catches up (snapshot plus log), becomes a voter, and
        ``node`` is removed from the group; then cells may run on it. Raises
        :class:`KernelError` if that did not happen within ``timeout`` seconds or a
        majority of the replicas is not alive.
        """
        if self._replacer is None:
            raise KernelError(f"kernel {self.kernel_id} cannot replace replicas")
        return await self._replacer.replace(node, timeout=timeout, target=target)

    async def retire(self) -> None:
        """Record, where the gateway keeps its kernels, that this kernel is shut down: what
        :meth:`shutdown` does first. For a caller that must know before it lets go of the
        kernel; raises :class:`~nbos.core.errors.StateWriteError` (nothing changed then)."""
        if self._retire is None or self._retired or self.closed.is_set():
            return
        await self._retire()
        self._retired = True

    def let_go(self) -> None:
        """Close this object's own client of the kernel: the kernel was shut down, or the
        gateway stops and leaves it running. Left to the garbage collector, the client's
        sockets would hang whichever thread collected them."""
        self._let_go = True
        if self._cells is not None:
            self._cells.close()
            self._cells = None

    def _process(self, node: int) -> ProcessHandle:
        handle = self._processes.get(node)
        if handle is None:
            raise KernelError(f"kernel {self.kernel_id} has no replica {node}")
        return handle

    async def shutdown(self) -> None:
        """Stop every replica and the front; idempotent.

        Raises :class:`~nbos.core.errors.StateWriteError` when the gateway could not
        record the shutdown: the kernel then runs on, as its record says.
        """
        if self.closed.is_set():
            return
        await self.retire()
        self.let_go()
        if self._replacer is not None:
            self._replacer.close()
        with anyio.CancelScope(shield=True):
            await stop_processes(self.front, self._processes)
        self._scope.cancel()
        self.closed.set()


async def stop_processes(front: KernelFront, by_node: Mapping[int, ProcessHandle]) -> None:
    """Ask live replicas to shut down, then terminate whatever is still running."""
    front.closing()
    with anyio.move_on_after(_SHUTDOWN_GRACE_S):
        async with anyio.create_task_group() as tg:
            for node in front.alive:
                tg.start_soon(_ask_shutdown, front, node, by_node[node])
    # At once: each waits for its host, and an unreachable one for its whole timeout.
    async with anyio.create_task_group() as tg:
        for handle in list(by_node.values()):  # a replacement may change it meanwhile
            if handle.returncode is None:
                tg.start_soon(_terminate, handle)


async def _terminate(handle: ProcessHandle) -> None:
    try:
        await handle.terminate(grace=1.0)
    except NbosError as exc:  # the others are stopped all the same
        log.warning("replica on %s not stopped: %s", handle.host, exc)


async def _ask_shutdown(front: KernelFront, node: int, handle: ProcessHandle) -> None:
    # A replica replies once its Raft member has stopped; what is left is interpreter
    # teardown, which can take seconds (torch) and is safe to cut short.
    if node not in front.alive:  # removed by a replacement meanwhile: terminate() ends it
        return
    await front.control_request(node, "shutdown_request", {"restart": False}, timeout=2.0)
    with anyio.move_on_after(_EXIT_GRACE_S):
        await handle.wait()
