"""What the chaos runner drives: a kernel of the embedded cluster, or of a gateway by address.

Both are :class:`ChaosKernel` s: cells go through the kernel's front as any Jupyter
client's do, and faults and checks go to the same kernel code, in this process
(:class:`EmbeddedKernel`) or through the gateway's control API (:class:`GatewayKernel`,
whose requests run those same methods on the gateway's side).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal, Protocol, TypeVar

import anyio
import attrs

from nbos.cluster import CellClient, ExecuteResult, Kernel
from nbos.core.errors import KernelError, TransportError, UnknownKernelError
from nbos.gateway.control_api import (
    ControlError,
    ControlReply,
    ControlRequest,
    DigestRequest,
    KernelDigests,
    KernelInfo,
    RestartReplica,
    ShutdownKernel,
    SignalReplica,
    StartKernel,
    StatusRequest,
    call,
)

log = logging.getLogger(__name__)

#: What a nemesis may need of the cluster under test.
#: ``replica-processes``: signals to a kernel's replica processes, and restarts;
#: ``gateway-processes``: the gateway and the host agents, to ``kill -9`` and start again
#: (a cluster that ``nbos cluster up`` started);
#: ``partition``: a way to cut a host off the network and heal it (commands of the user's);
#: ``gateway-control``: the gateway's control address, to send it requests of its own;
#: ``local-gateway``: the gateway and its agents run on this machine, each in a process of
#: its own (found by its listening port), to stop, continue and load;
#: ``gateway-data-dir``: the gateway's ``[cluster] data_dir`` on this machine;
#: ``root``: this process runs as root (to mount a file system).
Capability = Literal[
    "replica-processes",
    "gateway-processes",
    "partition",
    "gateway-control",
    "local-gateway",
    "gateway-data-dir",
    "root",
]

#: What the embedded :class:`~nbos.cluster.LocalCluster` offers.
EMBEDDED: frozenset[Capability] = frozenset({"replica-processes"})

_POLL_S = 0.1
R = TypeVar("R")


@attrs.frozen
class KernelView:
    """The front's view of its kernel at one moment."""

    alive: tuple[int, ...]
    running_on: int | None
    last_executor: int | None
    last_exec_index: int
    #: Replica node -> the host it runs on.
    hosts: dict[int, str] = attrs.field(factory=dict)
    #: Replica node -> the pid of its process now (``None``: not known).
    pids: dict[int, int | None] = attrs.field(factory=dict)


class ChaosKernel(Protocol):
    """A kernel under test, and what the nemeses and checks may do to it."""

    @property
    def kernel_id(self) -> str: ...

    @property
    def offers(self) -> frozenset[Capability]:
        """The capabilities its cluster offers the nemeses."""
        ...

    @property
    def where(self) -> str:
        """The cluster, for messages (``embedded cluster``, ``gateway at ...``)."""
        ...

    async def view(self) -> KernelView: ...

    async def execute(self, code: str, *, timeout: float) -> ExecuteResult: ...

    async def digests(self, *, after: int, timeout: float) -> dict[int, str]:
        """Each live replica's namespace digest once it applied cell ``after``."""
        ...

    async def signal_replica(self, node: int, signum: int) -> None: ...

    async def wait_replica(self, node: int) -> None:
        """Return once the front counts the process of replica ``node`` signalled last
        dead, or the cluster started the replica again already."""
        ...

    async def restart_replica(self, node: int) -> None:
        """Start dead replica ``node`` again in place (:class:`KernelError` if it cannot)."""
        ...


@attrs.frozen
class EmbeddedKernel:
    """A kernel of the embedded cluster, in this process."""

    kernel: Kernel
    offers: frozenset[Capability] = EMBEDDED
    where: str = "embedded cluster"
    _struck: dict[int, int | None] = attrs.field(factory=dict, init=False)

    @property
    def kernel_id(self) -> str:
        return self.kernel.kernel_id

    async def view(self) -> KernelView:
        front = self.kernel.front
        return KernelView(
            tuple(front.alive),
            front.running_on,
            front.last_executor,
            front.last_exec_index,
            {r.node: r.host for r in self.kernel.replicas},
            {r.node: r.pid for r in self.kernel.replicas},
        )

    async def execute(self, code: str, *, timeout: float) -> ExecuteResult:
        return await self.kernel.execute(code, timeout=timeout)

    async def digests(self, *, after: int, timeout: float) -> dict[int, str]:
        return await self.kernel.digests(after=after, timeout=timeout)

    async def signal_replica(self, node: int, signum: int) -> None:
        self._struck[node] = (await self.view()).pids.get(node)
        await self.kernel.signal_replica(node, signum)

    async def wait_replica(self, node: int) -> None:
        await _struck_gone(self, node, self._struck.pop(node, None))

    async def restart_replica(self, node: int) -> None:
        await self.kernel.restart_replica(node)


class GatewayKernel:
    """A kernel of the ``nbos gateway`` at ``address``: cells through its front, faults
    and checks through the gateway's control API. Start one with :meth:`start`."""

    def __init__(
        self,
        address: str,
        info: KernelInfo,
        offers: frozenset[Capability] = EMBEDDED,
        *,
        request_timeout: float = 60.0,
    ) -> None:
        self.address = address
        self.offers = offers
        self.where = f"gateway at {address}"
        self._info = info
        self._timeout = request_timeout
        self._cells = CellClient(info.connection)
        self._struck: dict[int, int | None] = {}

    @classmethod
    @asynccontextmanager
    async def start(
        cls, address: str, offers: frozenset[Capability] = EMBEDDED, *, gpus: int = 0
    ) -> AsyncIterator[GatewayKernel]:
        """A new kernel on the gateway at ``address``, shut down when the block exits."""
        info = await _ask(address, StartKernel(gpus=gpus), KernelInfo, 120.0)
        kernel = cls(address, info, offers)
        try:
            yield kernel
        finally:
            kernel._cells.close()
            with anyio.CancelScope(shield=True):
                try:
                    await call(address, ShutdownKernel(info.kernel_id), timeout=30.0)
                except TransportError as exc:
                    log.warning("chaos: kernel %s not shut down: %s", info.kernel_id, exc)

    @property
    def kernel_id(self) -> str:
        return self._info.kernel_id

    @property
    def info(self) -> KernelInfo:
        """What the gateway said of the kernel last."""
        return self._info

    async def view(self) -> KernelView:
        """The gateway's view; while the gateway does not answer (killed, restarting,
        stopped), asked again for up to the request timeout, then :class:`KernelError`."""
        deadline = anyio.current_time() + self._timeout
        while True:
            try:
                status = await self._ask(StatusRequest(), timeout=5.0)
            except TransportError as exc:
                if anyio.current_time() >= deadline:
                    raise KernelError(
                        f"the gateway at {self.address} did not answer for {self._timeout:g} s"
                    ) from exc
                await anyio.sleep(_POLL_S)
                continue
            mine = [k for k in getattr(status, "kernels", []) if k.kernel_id == self.kernel_id]
            if not mine:
                raise UnknownKernelError(self.kernel_id)
            self._info = info = mine[0]
            return KernelView(
                tuple(r.node for r in info.replicas if r.alive),
                info.running_on,
                info.last_executor,
                info.last_exec_index,
                {r.node: r.host for r in info.replicas},
                {r.node: r.pid for r in info.replicas},
            )

    async def execute(self, code: str, *, timeout: float) -> ExecuteResult:
        return await self._cells.execute(code, timeout=timeout)

    async def digests(self, *, after: int, timeout: float) -> dict[int, str]:
        request = DigestRequest(self.kernel_id, after, timeout)
        reply = await _ask(self.address, request, KernelDigests, self._timeout + 3 * timeout)
        return reply.digests

    async def signal_replica(self, node: int, signum: int) -> None:
        self._struck[node] = (await self.view()).pids.get(node)
        request = SignalReplica(self.kernel_id, node, int(signum))
        self._info = await _ask(self.address, request, KernelInfo, self._timeout)

    async def wait_replica(self, node: int) -> None:
        await _struck_gone(self, node, self._struck.pop(node, None))

    async def restart_replica(self, node: int) -> None:
        request = RestartReplica(self.kernel_id, node)
        self._info = await _ask(self.address, request, KernelInfo, self._timeout + 60.0)

    async def _ask(self, request: ControlRequest, *, timeout: float) -> ControlReply:
        return await call(self.address, request, timeout=timeout)


async def _struck_gone(kernel: ChaosKernel, node: int, struck: int | None) -> None:
    """Until the front counts replica ``node``'s process ``struck`` (a pid) dead, or the
    replica runs as another process: a kernel that lost its majority restarts its dead
    in place at once, maybe before a poll saw them dead."""
    while True:
        view = await kernel.view()
        if node not in view.alive or view.pids.get(node) != struck:
            return
        await anyio.sleep(_POLL_S)


async def _ask(address: str, request: ControlRequest, kind: type[R], timeout: float) -> R:
    """The gateway's reply of type ``kind``; :class:`KernelError` for any other answer."""
    reply = await call(address, request, timeout=timeout)
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, ControlError) and reply.kind == "unknown":
        raise UnknownKernelError(getattr(request, "kernel_id", "?"))
    detail = reply.message if isinstance(reply, ControlError) else type(reply).__name__
    raise KernelError(f"gateway at {address}: {type(request).__name__}: {detail}")
