"""The gateway's control API: msgspec requests and replies over one ZeroMQ endpoint.

A client sends one request on a ``REQ`` (or ``DEALER``) socket to ``[gateway]
address`` and gets one reply: msgpack of the structs below, tagged by class name,
decoded strictly. Anything that does not decode, or that the gateway cannot do, is
answered with :class:`ControlError` (and logged); the endpoint goes on.

=========================  ==========================
request                    reply
=========================  ==========================
``StartKernel(gpus)``      ``KernelInfo``
``ListKernels()``          ``KernelList``
``ShutdownKernel(id)``     ``KernelList`` (the rest)
``StatusRequest()``        ``ClusterStatus``
``WatchKernel(id, wait)``  ``KernelInfo``
``UsageRequest()``         ``Usage``
``SignalReplica(id, ...)``  ``KernelInfo``
``RestartReplica(id, ...)`` ``KernelInfo``
``DigestRequest(id, ...)``  ``KernelDigests``
``ShutdownCluster()``      ``KernelList`` (empty)
=========================  ==========================

Nothing else shuts kernels down: a gateway with a data dir that exits (SIGTERM, a
crash) leaves them running for its next start. ``ShutdownCluster`` shuts every kernel
down, then the gateway exits, stopping the replicas and local agents it runs
(``nbos cluster down`` sends it).

A request naming a kernel that does not run (or that ended during a ``WatchKernel``)
is answered with ``ControlError(kind="unknown")``. The last three are the fault
injection and checks of ``nbos chaos --gateway``: whoever reaches the control address
may already shut any kernel down, and these add no more than that (signals go only to
the kernels' own replica processes).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import msgspec
import zmq
import zmq.asyncio

from nbos.core.errors import NbosError, TransportError, UnknownKernelError
from nbos.scaling.ledger import CellUsage, HostCount, Ledger, Totals

log = logging.getLogger(__name__)

#: ``joining``: registered, its GPUs not yet reported to the scheduler (nothing is placed
#: there yet); ``up``: schedulable; ``suspected``: silent past the missed-heartbeat limit.
HostState = Literal["joining", "up", "suspected"]
ControlErrorKind = Literal["malformed", "failed", "unknown"]


class _Msg(msgspec.Struct, forbid_unknown_fields=True, tag=True, tag_field="t"):
    pass


class StartKernel(_Msg):
    """Start a kernel whose cells ask for ``gpus`` GPUs by default.

    ``connection``: the ``key`` and ports (``shell_port`` ...) its front binds, those
    of the kernel it replaces on a restart (so open client channels go on working);
    ``None``: new ones. ``lease_s``: the kernel is shut down once no
    :class:`WatchKernel` for it was pending for that long (its owner died); ``None``:
    it lives until shut down.
    """

    gpus: int = 0
    connection: dict[str, str | int] | None = None
    lease_s: float | None = None


class ListKernels(_Msg):
    pass


class ShutdownKernel(_Msg):
    kernel_id: str


class ShutdownCluster(_Msg):
    """Shut every kernel down (answered once they are), then stop the gateway."""


class StatusRequest(_Msg):
    pass


class WatchKernel(_Msg):
    """Answered once the kernel ended (``unknown``), or with its state after ``wait_s``.

    A pending watch holds the kernel's lease (:class:`StartKernel`).
    """

    kernel_id: str
    wait_s: float = 1.0


class SignalReplica(_Msg):
    """Send signal number ``signal`` (``SIGKILL``, ``SIGSTOP``, ``SIGCONT`` ...) to the
    process of replica ``node``, through its host's agent."""

    kernel_id: str
    node: int
    signal: int


class RestartReplica(_Msg):
    """Start dead replica ``node`` again on its host, from its durable Raft log; answered
    once it serves (within ``timeout_s``)."""

    kernel_id: str
    node: int
    timeout_s: float = 60.0


class DigestRequest(_Msg):
    """Each live replica's namespace digest once it applied cell ``after`` (``None``:
    the last cell the front settled), each replica given ``timeout_s``."""

    kernel_id: str
    after: int | None = None
    timeout_s: float = 30.0


class KernelDigests(_Msg):
    """Digests by replica node; replicas that applied the same cells have equal ones."""

    after: int
    digests: dict[int, str]


class ReplicaStatus(_Msg):
    """One replica: its Raft node id, host, the address it listens at, pid, liveness."""

    node: int
    host: str
    ip: str
    pid: int | None
    alive: bool


class KernelInfo(_Msg):
    """A kernel: its front's connection info (what a Jupyter client loads) and replicas.

    ``running_on``: the replica running a cell now; ``last_executor``: the one that ran
    the last cell; ``last_exec_index``: the index of the last cell the front settled.
    """

    kernel_id: str
    connection: dict[str, str | int]
    replicas: list[ReplicaStatus]
    running_on: int | None = None
    last_executor: int | None = None
    last_exec_index: int = 0


class KernelList(_Msg):
    kernels: list[KernelInfo]


class HostStatus(_Msg):
    """One host and its GPUs by state (``resident``: idle, holding a kernel's tensors)."""

    host_id: str
    address: str
    state: HostState
    gpus: int
    idle: int
    precommitted: int
    committed: int
    resident: int


class ClusterStatus(_Msg):
    hosts: list[HostStatus]
    kernels: list[KernelInfo]


class UsageRequest(_Msg):
    """The gateway's accounting since it started (what ``nbos replay`` reports)."""


class Usage(_Msg):
    """The gateway's :class:`~nbos.scaling.ledger.Ledger`: every cell's grant, the host
    count over time, and its totals, all in wall-clock seconds."""

    since: float
    now: float
    cells: list[CellUsage]
    hosts: list[HostCount]
    totals: Totals

    @classmethod
    def of(cls, ledger: Ledger) -> Usage:
        return cls(ledger.since, ledger.now(), ledger.cells(), ledger.hosts(), ledger.totals())


class ControlError(_Msg):
    kind: ControlErrorKind
    message: str


ControlRequest = (
    StartKernel
    | ListKernels
    | ShutdownKernel
    | StatusRequest
    | WatchKernel
    | UsageRequest
    | SignalReplica
    | RestartReplica
    | DigestRequest
    | ShutdownCluster
)
ControlReply = KernelInfo | KernelList | ClusterStatus | Usage | KernelDigests | ControlError

_requests = msgspec.msgpack.Decoder(ControlRequest)
_replies = msgspec.msgpack.Decoder(ControlReply)
_encoder = msgspec.msgpack.Encoder()

#: ``handle(request)``: the gateway's answer; an ``NbosError`` becomes a ``ControlError``.
Handler = Callable[[ControlRequest], Awaitable[ControlReply]]


async def serve_control(socket: zmq.asyncio.Socket, handle: Handler) -> None:
    """Answer requests on ``socket`` (a bound ``ROUTER``), each in its own task, forever.

    A kernel start takes seconds; status requests meanwhile are answered at once.
    """

    async def answer(route: list[bytes], body: bytes) -> None:
        reply: ControlReply
        try:
            request = _requests.decode(body)
        except msgspec.DecodeError as exc:
            log.warning("control: malformed request: %s", exc)
            reply = ControlError("malformed", str(exc))
        else:
            try:
                reply = await handle(request)
            except UnknownKernelError as exc:
                reply = ControlError("unknown", str(exc))
            except NbosError as exc:
                log.warning("control: %s failed: %s", type(request).__name__, exc)
                reply = ControlError("failed", str(exc))
        await socket.send_multipart([*route, _encoder.encode(reply)])

    async with anyio.create_task_group() as tg:
        while True:
            *route, body = await socket.recv_multipart()
            tg.start_soon(answer, route, body)


async def call(address: str, request: ControlRequest, timeout: float = 120.0) -> ControlReply:
    """Send ``request`` to the gateway at ``address`` (``HOST:PORT``); its reply.

    Raises :class:`TransportError` when no reply came within ``timeout`` seconds.
    """
    ctx = zmq.asyncio.Context.instance()
    socket = ctx.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address if address.startswith("tcp://") else f"tcp://{address}")
    try:
        await socket.send(_encoder.encode(request))
        if not await socket.poll(int(timeout * 1000)):
            raise TransportError(f"no answer from the gateway at {address} in {timeout:g} s")
        reply: ControlReply = _replies.decode(await socket.recv())
        return reply
    finally:
        socket.close()
