"""Gateway <-> host agent messages: GPU reservations on one host.

Requests go from the gateway's scheduler to a host agent and carry a
``request_id``; the agent answers each with exactly one reply carrying the same
id (:class:`GpuGranted`, :class:`GpuRefused`, :class:`GpuFreed` or
:class:`AgentStatus`). The transport may lose or duplicate messages, so the
scheduler retries and every request is idempotent on the agent.

The agent also sends :class:`AgentStatus` unprompted (``request_id=None``): when it
starts and at every heartbeat. A new ``incarnation`` tells the gateway that the
agent restarted; it then sends :class:`AgentRestore` with the committed
reservations the agent lost.

Registration and replica processes (``nbos agent``, see ``docs/deploy.md``): the
agent sends :class:`AgentHello` when it starts and every heartbeat until the
gateway answers :class:`AgentWelcome` for that incarnation (and again whenever
asked with :class:`AgentHelloRequest`). The gateway starts, signals and stops
replica processes with :class:`ReplicaStart`, :class:`ReplicaSignal` and
:class:`ReplicaStop` (answered by :class:`ReplicaState`) and lists them with
:class:`ReplicaListRequest` (answered by :class:`ReplicaList`). A replica's end is
reported with :class:`ReplicaExited`, resent every heartbeat until the gateway
acknowledges it with :class:`ReplicaExitAck`. A request the agent cannot decode or
carry out is answered with :class:`AgentError`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from nbos.core.wire.base import Message

ReservationStateName = Literal["precommitted", "committed", "released", "expired"]
RefusalReason = Literal["insufficient", "unknown", "expired", "invalid", "evict_failed"]
GpuSource = Literal["nvml", "virtual"]
#: ``malformed``: undecodable bytes; ``unexpected``: a message the agent does not take;
#: ``unknown_replica``: no such replica here; ``start_failed``: the backend could not start
#: it; ``invalid``: a request with bad values.
AgentErrorKind = Literal["malformed", "unexpected", "unknown_replica", "start_failed", "invalid"]
#: Why a gateway refused an :class:`AgentJoin` (``docs/deploy.md``, "Join token").
JoinRefusalKind = Literal["malformed", "bad_proof", "expired", "replayed", "host_taken"]


class GpuReservation(Message):
    """One reservation as the agent's pool holds it; ``evict_from`` is ``(device, kernel)``."""

    reservation_id: str
    kernel_id: str
    devices: list[int]
    state: ReservationStateName
    evict_from: list[tuple[int, str]] = []


# --- requests (gateway -> agent) -------------------------------------------------


class GpuPrecommit(Message, omit_defaults=True):
    """Reserve ``n`` devices for an expected executor of ``kernel_id``; a device where one of
    the ``evict_first`` kernels is resident is taken before one of another kernel's."""

    request_id: int
    reservation_id: str
    kernel_id: str
    n: int
    #: Left out on the wire when empty (no quotas), as agents before it expect.
    evict_first: list[str] = []


class GpuCommit(Message, omit_defaults=True):
    """Bind a reservation to a running cell (taken fresh if the agent lost it, as
    :class:`GpuPrecommit` takes devices)."""

    request_id: int
    reservation_id: str
    kernel_id: str
    n: int
    evict_first: list[str] = []


class GpuRelease(Message):
    """Free a reservation; ``resident`` leaves the kernel's tensors on the devices (lazily)."""

    request_id: int
    reservation_id: str
    resident: bool = False


class GpuReleaseKernel(Message):
    """Free every reservation and resident mark of a kernel on this host."""

    request_id: int
    kernel_id: str


class GpuEvicted(Message):
    """The kernel's replica on this host moved its resident tensors off every device."""

    request_id: int
    kernel_id: str


class AgentStatusRequest(Message):
    """Ask for an :class:`AgentStatus` now."""

    request_id: int


class AgentRestore(Message):
    """After an agent restart: committed reservations the gateway knows the agent held."""

    request_id: int
    reservations: list[GpuReservation]


# --- replies and reports (agent -> gateway) --------------------------------------


class GpuGranted(Message):
    """The reservation as the pool holds it after the request."""

    request_id: int
    reservation: GpuReservation


class GpuRefused(Message):
    """A request the agent could not carry out; ``idle`` is its idle device count now."""

    request_id: int
    reason: RefusalReason
    message: str
    idle: int = 0


class GpuFreed(Message):
    """Answer to release, release-kernel, evicted and restore: reservations freed, devices freed."""

    request_id: int
    reservation_ids: list[str] = []
    devices: list[int] = []


class AgentStatus(Message):
    """The agent's whole pool: on start, every heartbeat, and in answer to a status request.

    ``reservations`` are the live ones (pre-committed and committed); ``resident``
    lists idle devices still holding a kernel's tensors as ``(device, kernel)``.
    ``memory_available_mib``: the host's memory available for new processes (Linux's
    ``MemAvailable``; ``None`` where not known): placement keeps new replicas off a host
    short of it.
    """

    host_id: str
    incarnation: str
    address: str
    devices: list[int]
    reservations: list[GpuReservation] = []
    resident: list[tuple[int, str]] = []
    request_id: int | None = None
    memory_available_mib: int | None = None


# --- registration (agent <-> gateway) -----------------------------------------------


class GpuInfo(Message):
    """One device of the host, as its discovery found it."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int


class ReplicaOwner(Message):
    """Whose a replica is, kept by its agent and reported with it: the gateway state that
    started it (its state id, see ``nbos.gateway._state``) and that state's generation
    then (the file's last write), and its place in its kernel (kernel id, node id, Raft
    address, the kernel's GPUs per cell, the user the kernel belongs to).

    A gateway that finds a replica of no kernel it knows decides by it: one of its own
    state that a later generation of the file no longer names was dropped from it
    (stopped); one of another state, or newer than the file (an older copy), is adopted.
    """

    state: str
    generation: int
    kernel_id: str
    node: int
    raft: str
    gpus: int = 0
    user: str = ""


class ReplicaSpec(Message):
    """A replica process to start: argv, extra environment, a label for logs.

    ``workdir`` (a relative path of names) asks for a directory on the host, under
    the agent's state directory, kept across restarts of the replica; every
    ``{workdir}`` in ``argv`` becomes its absolute path. ``connection_key`` makes it
    a Jupyter kernel: the agent seeds ``{workdir}/connection.json`` with the host's
    address, this HMAC key and ports 0 (the kernel binds free ports and writes them
    back), and :class:`ReplicaConnectionRequest` reads it. The gateway names a kernel's
    replica's workdir ``KERNEL_ID/replica-N``: the agent finds a kernel's replica by it when
    the host needs the devices its tensors stay on (lazy eviction).
    """

    argv: list[str]
    env: dict[str, str] = {}
    label: str = ""
    workdir: str = ""
    connection_key: str = ""
    owner: ReplicaOwner | None = None


class ReplicaInfo(Message):
    """A replica process the agent started (or took back after its own restart).

    ``handle`` names it to its backend (``pid:1234``, ``container:NAME``); ``pid`` is
    0 where the agent cannot see one. ``started_at`` is Unix time. Once it ended,
    ``running`` is false and ``exit_code`` (normal exit) or ``signal`` (killed by a
    signal) says how, where known: an adopted local process is not the agent's child,
    so its status is lost and both stay ``None``. ``owner`` is its spec's (``None`` for a
    replica started without one, or by an older agent); ``spec``, the whole spec it was
    started with, only in a :class:`ReplicaList` asked ``with_specs``.
    """

    replica_id: str
    label: str
    handle: str
    pid: int
    started_at: float
    adopted: bool = False
    running: bool = True
    exit_code: int | None = None
    signal: int | None = None
    owner: ReplicaOwner | None = None
    spec: ReplicaSpec | None = None


class AgentHello(Message):
    """Registration: who the agent is, where it listens, what it has.

    ``public_key`` is the agent's CURVE public key (Z85; empty without CURVE): the
    gateway checks it against the key it holds for ``host_id`` and uses it to
    connect to ``address``. ``replicas`` are the live and unacknowledged ones.
    """

    host_id: str
    incarnation: str
    address: str
    version: str
    backend: str
    gpu_source: GpuSource
    gpus: list[GpuInfo] = []
    public_key: str = ""
    replicas: list[ReplicaInfo] = []
    request_id: int | None = None


class AgentWelcome(Message):
    """The gateway took the hello of this agent incarnation (no reply)."""

    host_id: str
    incarnation: str


class AgentHelloRequest(Message):
    """Ask for an :class:`AgentHello` now (a restarted gateway meeting a host it lost)."""

    request_id: int


# --- replica processes -------------------------------------------------------------


class ReplicaStart(Message):
    """Start a replica process; a known ``replica_id`` gets its state, not a second process."""

    request_id: int
    replica_id: str
    spec: ReplicaSpec


class ReplicaSignal(Message):
    """Send signal ``signum`` to a replica (its whole process group or container)."""

    request_id: int
    replica_id: str
    signum: int


class ReplicaStop(Message):
    """SIGTERM a replica, SIGKILL it after ``grace`` seconds; answered once it ended."""

    request_id: int
    replica_id: str
    grace: float = 5.0


class ReplicaListRequest(Message):
    """Ask for every replica the agent holds; ``with_specs``: each with its whole spec
    (environment and keys included), which a gateway adopting replicas needs."""

    request_id: int
    with_specs: bool = False


class ReplicaConnectionRequest(Message):
    """Ask for a replica's Jupyter connection info (answered by :class:`ReplicaConnection`)."""

    request_id: int
    replica_id: str


class PortsRequest(Message):
    """Ask for ``count`` TCP ports free on the host's address (answered by :class:`PortsGranted`).

    The agent never hands out a port twice, so the gateway can give them to processes
    that are told their peers' addresses before any of them binds.
    """

    request_id: int
    count: int


class ReplicaState(Message):
    """Answer to start, signal and stop: the replica as it is now."""

    request_id: int
    replica: ReplicaInfo


class ReplicaList(Message):
    """Answer to :class:`ReplicaListRequest`."""

    request_id: int
    replicas: list[ReplicaInfo] = []


class ReplicaConnection(Message):
    """A replica's connection file; ``info`` is empty until the kernel wrote its ports."""

    request_id: int
    replica_id: str
    info: dict[str, str | int] = {}


class PortsGranted(Message):
    """Answer to :class:`PortsRequest`: ``ip`` is the host's address, ``ports`` free on it."""

    request_id: int
    ip: str
    ports: list[int]


class ReplicaExited(Message):
    """A replica ended (``replica.running`` is false); resent until acknowledged."""

    host_id: str
    replica: ReplicaInfo


class ReplicaExitAck(Message):
    """The gateway took note of a :class:`ReplicaExited`; the agent forgets the replica."""

    replica_id: str


class AgentError(Message):
    """A request the agent could not decode or carry out (``request_id`` when it had one)."""

    kind: AgentErrorKind
    message: str
    request_id: int | None = None
    replica_id: str = ""


# --- an agent told to stop (SIGTERM): leave at once, or once its host is emptied ---------


class AgentLeaving(Message):
    """The agent of ``host_id`` was told to stop (SIGTERM): may it go now? Sent every
    heartbeat until the gateway says so (``docs/deploy.md``, "Draining a node")."""

    host_id: str
    incarnation: str


class LeaveAdvice(Message):
    """``wait``: the gateway is moving the host's replicas off (its node is being drained),
    so the agent stays until told otherwise; else it may go, leaving its replicas
    running (a restart or an upgrade: the next agent takes them back)."""

    host_id: str
    wait: bool
    reason: str


# --- joining with a token (agent -> the gateway's join endpoint, and its answer) ----------


class AgentJoin(Message):
    """An agent with a key pair of its own asks to be admitted as ``host_id``.

    ``proof`` is :func:`nbos.transport.join.join_proof` over the other fields (the join
    token's secret as the HMAC key); ``timestamp`` is the agent's time (seconds since
    the epoch) and ``nonce`` fresh for each try, so that a join cannot be replayed.
    """

    host_id: str
    public_key: str
    nonce: str
    timestamp: float
    proof: str


class AgentJoined(Message):
    """The gateway pinned ``public_key`` for ``host_id``: its agent may say hello now."""

    host_id: str
    public_key: str


class JoinRefused(Message):
    """The gateway refused a join; ``host_taken``: another key is pinned for that host."""

    kind: JoinRefusalKind
    message: str


AgentRequest = (
    GpuPrecommit
    | GpuCommit
    | GpuRelease
    | GpuReleaseKernel
    | GpuEvicted
    | AgentStatusRequest
    | AgentRestore
)
AgentReply = GpuGranted | GpuRefused | GpuFreed | AgentStatus
ReplicaRequest = (
    ReplicaStart
    | ReplicaSignal
    | ReplicaStop
    | ReplicaListRequest
    | ReplicaConnectionRequest
    | PortsRequest
)
ReplicaReply = ReplicaState | ReplicaList | ReplicaConnection | PortsGranted | AgentError
#: What a gateway sends an agent besides :data:`AgentRequest`.
AgentControl = ReplicaRequest | AgentHelloRequest | AgentWelcome | ReplicaExitAck | LeaveAdvice
#: What an agent sends a gateway besides :data:`AgentReply`.
AgentReport = ReplicaReply | AgentHello | ReplicaExited | AgentLeaving
AgentMessage = (
    AgentRequest
    | AgentReply
    | GpuReservation
    | AgentControl
    | AgentReport
    | GpuInfo
    | ReplicaSpec
    | ReplicaOwner
    | ReplicaInfo
    | AgentJoin
    | AgentJoined
    | JoinRefused
)


#: The only argument of a pre-started replica (``python -m nbos.kernel.replica --warm``).
WARM_FLAG = "--warm"


class WarmAssignment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an agent tells a pre-started replica process to become (``docs/deploy.md``).

    One JSON line on the process's stdin: ``argv`` are the arguments of
    ``python -m nbos.kernel.replica`` (what follows the module name), ``env`` the
    replica's extra environment. Not a gateway message: it never leaves the host.
    """

    argv: list[str]
    env: dict[str, str] = {}
