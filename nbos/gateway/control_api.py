"""The gateway's control API: msgspec requests and replies over one ZeroMQ endpoint.

A client sends one request on a ``REQ`` (or ``DEALER``) socket to ``[gateway]
address`` and gets one reply: msgpack of the structs below, tagged by class name,
decoded strictly. Anything that does not decode, or that the gateway cannot do, is
answered with :class:`ControlError` (and logged); the endpoint goes on.

Every request travels in an :class:`Envelope` with the token of whoever sends it (a
user's, or the gateway's operator token: ``docs/users.md``); one without, or with a
token nobody has, is answered ``ControlError(kind="unauthorized")`` and nothing else
happens. A user sees and acts on their own kernels only: another's is ``unknown``, as
if absent; an admin sees all. The cluster-wide requests (``UsageRequest``,
``SignalReplica``, ``RestartReplica``, ``ShutdownCluster``) are an admin's only, any
other user's is answered ``ControlError(kind="forbidden")``.

=========================  ==========================
request                    reply
=========================  ==========================
``StartKernel(gpus)``      ``KernelInfo`` (``early``: ``starting`` while it waits)
``ListKernels()``          ``KernelList`` (``starts``: the starts under way too)
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
is answered with ``ControlError(kind="unknown")``; a ``StartKernel`` the gateway takes no
room for now (``[gateway] max_starting`` starts under way and none ended within
``start_wait_s``, or no host with room) with ``ControlError(kind="overloaded")``, whose
``retry_after_s`` says when to ask again.
A start that waits for a host the autoscaler adds is answered once the kernel runs, or with
``early=True`` at once (``starting``; :func:`start_kernel` waits for it then).

``SignalReplica``, ``RestartReplica`` and ``DigestRequest`` are the fault injection and
checks of ``nbos chaos --gateway`` (signals go only to the kernels' own replica
processes).

Every field of every request is bounded by the struct itself (the ``Annotated`` types
below): NaN, infinities, negative or absurd numbers, overlong strings and oversized
maps do not decode, and are answered with ``ControlError(kind="malformed")`` naming
the field. A request that fails for any other reason, an unexpected error included, is
answered with ``ControlError(kind="failed")`` and logged; no request ends the endpoint
or touches another request. A message over :data:`MAX_REQUEST_BYTES` is dropped by
ZeroMQ with its connection, unanswered.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

import anyio
import msgspec
import zmq
import zmq.asyncio

from nbos.core.errors import (
    ForbiddenError,
    IdentityProviderError,
    KernelError,
    NbosError,
    OverloadedError,
    TransportError,
    UnauthorizedError,
    UnknownKernelError,
)
from nbos.core.identity import User, UserName
from nbos.gateway._kernel_state import KernelState
from nbos.gateway.auth import client_token
from nbos.metrics import ClusterEvent, events
from nbos.scaling.ledger import CellUsage, HostCount, Ledger, Totals

log = logging.getLogger(__name__)

#: ``joining``: registered, its GPUs not yet reported to the scheduler (nothing is placed
#: there yet); ``up``: schedulable; ``suspected``: silent past the missed-heartbeat limit.
HostState = Literal["joining", "up", "suspected"]
ControlErrorKind = Literal[
    "malformed", "failed", "unknown", "overloaded", "unauthorized", "forbidden"
]

#: How long a client waits for the answer to a shutdown or a watch beyond its wait.
_SHUTDOWN_TIMEOUT_S = 60.0
#: A request message above this is dropped by ZeroMQ (with its connection) before it is
#: read: the largest valid one, a start with its connection, is a few hundred bytes.
MAX_REQUEST_BYTES = 64 * 1024

# The bounds of the requests' fields. They refuse nonsense (NaN, infinities, negatives,
# sizes no cluster has), not big clusters or patient clients.
#: Kernel ids are UUIDs (36 characters).
KernelIdField = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
#: GPUs per cell: more than any host holds is refused by placement, beyond this by decoding.
Gpus = Annotated[int, msgspec.Meta(ge=0, le=1024)]
#: A week: the longest wait, timeout or lease a request may ask for.
MAX_SECONDS = 7 * 24 * 3600.0
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
#: Raft node ids start at 1 and grow by one per replacement, never reused.
Node = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
#: Signal numbers of this platform (``signal.valid_signals``); 0, a mere probe, is none.
SignalNumber = Annotated[int, msgspec.Meta(ge=1, le=int(max(signal.valid_signals())))]
#: A cell index (the front's ``last_exec_index``).
CellIndex = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: What a restarted kernel's front takes over from the connection info it replaces: its
#: ``key`` and its ports (see :func:`nbos.jupyter.host.reused_connection`).
Connection = Annotated[
    dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=64)],
        Annotated[str, msgspec.Meta(max_length=256)] | Annotated[int, msgspec.Meta(ge=1, le=65535)],
    ],
    msgspec.Meta(max_length=16),
]


class _Msg(msgspec.Struct, forbid_unknown_fields=True, tag=True, tag_field="t"):
    pass


class StartKernel(_Msg, omit_defaults=True):
    """Start a kernel whose cells ask for ``gpus`` GPUs by default.

    ``connection``: the ``key`` and ports (``shell_port`` ...) its front binds, those
    of the kernel it replaces on a restart (so open client channels go on working);
    ``None``: new ones. ``lease_s``: the kernel is shut down once no
    :class:`WatchKernel` for it was pending for that long (its owner died); ``None``:
    it lives until shut down. ``user``: the user it is started for, who owns it (an
    admin's request only, as Enterprise Gateway's impersonation; ``None``: the sender).

    ``early``: answer as soon as the start waits for a host the autoscaler adds, with
    the kernel ``starting`` (``KernelInfo.waiting`` says why), not once it runs; a
    :class:`WatchKernel` then waits for it (:func:`start_kernel` does both). Fields at
    their defaults are left out of the message, so a gateway from before ``early`` takes
    every start that does not ask for it.
    """

    gpus: Gpus = 0
    connection: Connection | None = None
    lease_s: PositiveSeconds | None = None
    user: UserName | None = None
    early: bool = False


class ListKernels(_Msg, omit_defaults=True):
    """The kernels, and with ``starts`` the starts under way too (``starting``, each with
    ``waiting`` while it waits for a host; left out when false, as ``StartKernel.early``)."""

    starts: bool = False


class ShutdownKernel(_Msg):
    kernel_id: KernelIdField


class ShutdownCluster(_Msg):
    """Shut every kernel down (answered once they are), then stop the gateway."""


class StatusRequest(_Msg, omit_defaults=True):
    """The hosts and kernels, and with ``starts`` the starts under way too (as
    :class:`ListKernels`)."""

    starts: bool = False


class WatchKernel(_Msg):
    """Answered once the kernel ended (``unknown``), or with its state after ``wait_s``.

    A pending watch holds the kernel's lease (:class:`StartKernel`). Of a kernel whose
    start was answered early: answered once it runs, or with the start's error, or after
    ``wait_s`` with it ``starting``.
    """

    kernel_id: KernelIdField
    wait_s: Seconds = 1.0


class SignalReplica(_Msg):
    """Send signal number ``signal`` (``SIGKILL``, ``SIGSTOP``, ``SIGCONT`` ...) to the
    process of replica ``node``, through its host's agent."""

    kernel_id: KernelIdField
    node: Node
    signal: SignalNumber


class RestartReplica(_Msg):
    """Start dead replica ``node`` again on its host, from its durable Raft log; answered
    once it serves (within ``timeout_s``)."""

    kernel_id: KernelIdField
    node: Node
    timeout_s: PositiveSeconds = 60.0


class DigestRequest(_Msg):
    """Each live replica's namespace digest once it applied cell ``after`` (``None``:
    the last cell the front settled), each replica given ``timeout_s``."""

    kernel_id: KernelIdField
    after: CellIndex | None = None
    timeout_s: PositiveSeconds = 30.0


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


class KernelInfo(_Msg, omit_defaults=True):
    """A kernel: its front's connection info (what a Jupyter client loads) and replicas.

    ``owner``: the user who started it (``""``: a kernel from before users, an admin's).

    ``running_on``: the replica running a cell now; ``last_executor``: the one that ran
    the last cell; ``last_exec_index``: the index of the last cell the front settled;
    ``state``: the kernel's state (``docs/kernel.md``, Kernel states; ``None`` from a
    gateway older than states).

    ``api_id``: the id the Kernel Gateway HTTP API (and so JupyterLab) shows for it,
    which an API restart keeps while ``kernel_id`` changes (``None``: not started
    through the API); ``gpus``: its GPUs per cell; ``started_at``: when it was started,
    UNIX seconds, kept across gateway restarts (each ``None`` from an older gateway).

    A start not running yet (``state == "starting"``: ``StartKernel(early=True)``,
    ``ListKernels(starts=True)``) has no ``connection`` and no ``replicas`` yet, and
    ``waiting`` says why while it waits for a host. Fields at their defaults are left out
    of the message, so a client from before ``waiting`` decodes every other kernel.
    """

    kernel_id: str
    connection: dict[str, str | int]
    replicas: list[ReplicaStatus]
    running_on: int | None = None
    last_executor: int | None = None
    last_exec_index: int = 0
    state: KernelState | None = None
    owner: str = ""
    api_id: str | None = None
    gpus: int | None = None
    started_at: float | None = None
    waiting: str | None = None


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


class ControlError(_Msg, omit_defaults=True):
    """A request refused or failed; ``retry_after_s``: ask again after that long (only
    with ``overloaded``, and left out of the message otherwise, so that clients from
    before it decode every other error)."""

    kind: ControlErrorKind
    message: str
    retry_after_s: float | None = None


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

#: Tokens: the operator's and users' are 43 characters; a Hub's 32.
Token = Annotated[str, msgspec.Meta(max_length=1024)]


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """What a client sends: its ``token`` and its ``request``."""

    token: Token
    request: ControlRequest


_envelopes = msgspec.msgpack.Decoder(Envelope)
_requests = msgspec.msgpack.Decoder(ControlRequest)
_replies = msgspec.msgpack.Decoder(ControlReply)
_encoder = msgspec.msgpack.Encoder()

#: ``handle(user, request)``: the gateway's answer to ``user``. It may raise: an
#: ``NbosError`` becomes a ``ControlError`` with its message, any other exception one with
#: its traceback logged.
Handler = Callable[[User, ControlRequest], Awaitable[ControlReply]]
#: ``authenticate(token)``: whose the token is (see :class:`nbos.gateway.auth.Authenticator`).
Authenticate = Callable[[str], Awaitable[User]]


async def serve_control(
    socket: zmq.asyncio.Socket, handle: Handler, authenticate: Authenticate
) -> None:
    """Answer requests on ``socket`` (a bound ``ROUTER``), each in its own task, forever.

    A kernel start takes seconds; status requests meanwhile are answered at once. A
    request that fails, whatever the reason, is answered and ends nothing but itself;
    only a cancellation of the endpoint ends it.
    """

    async def answer(route: list[bytes], body: bytes) -> None:
        reply = await _reply_to(body, handle, authenticate)
        try:
            await socket.send_multipart([*route, _encoder.encode(reply)])
        except zmq.ZMQError as exc:  # the socket is closing: the gateway is leaving
            log.warning("control: reply not sent: %s", exc)

    async with anyio.create_task_group() as tg:
        while True:
            *route, body = await socket.recv_multipart()
            tg.start_soon(answer, route, body)


async def _reply_to(body: bytes, handle: Handler, authenticate: Authenticate) -> ControlReply:
    """The reply to one request message ``body``: ``handle``'s, or a :class:`ControlError`."""
    try:
        envelope = _envelopes.decode(body)
    # msgspec lets a string that is not UTF-8 raise UnicodeDecodeError (msgspec#714).
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return _undecodable(body, exc)
    name = type(envelope.request).__name__
    try:
        user = await authenticate(envelope.token)
    except (UnauthorizedError, IdentityProviderError) as exc:
        return _refused("unauthorized", f"{name} refused: {exc}")
    try:
        return await handle(user, envelope.request)
    except ForbiddenError as exc:
        return _refused("forbidden", f"{name} of {user.name} refused: {exc}", str(exc))
    except UnknownKernelError as exc:
        return ControlError("unknown", str(exc))
    except OverloadedError as exc:  # logged where it was refused
        return ControlError("overloaded", str(exc), exc.retry_after_s)
    except NbosError as exc:
        log.warning("control: %s failed: %s", name, exc)
        return ControlError("failed", str(exc))
    except Exception as exc:  # a bug: this request fails, the gateway and its kernels go on
        log.exception("control: %s failed unexpectedly", name)
        return ControlError("failed", f"{name} failed unexpectedly: {type(exc).__name__}: {exc}")


def sealed(request: bytes, token: str) -> bytes:
    """An :class:`Envelope` around the already encoded ``request``, with ``token``: for tools
    that send malformed requests on purpose (``nbos chaos``), as an authenticated client."""
    head = _encoder.encode({"token": token, "request": None})
    assert head.endswith(b"\xc0")  # msgpack's nil, the request's place
    return head[:-1] + request


def _undecodable(body: bytes, exc: Exception) -> ControlError:
    """The answer to a message that is no :class:`Envelope`: a request without one has no
    credentials; anything else is malformed."""
    try:
        request = _requests.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        log.warning("control: malformed request: %s", exc)
        return ControlError("malformed", str(exc))
    name = type(request).__name__
    return _refused("unauthorized", f"{name} refused: no credentials (a token is required)")


def _refused(kind: ControlErrorKind, why: str, message: str | None = None) -> ControlError:
    """The answer refusing a request for ``why`` (logged, and in the event log); its
    message is ``message``, else ``why``."""
    log.warning("control: %s", why)
    events().happened(ClusterEvent("refused", f"control: {why}"))
    return ControlError(kind, why if message is None else message)


async def call(
    address: str, request: ControlRequest, timeout: float = 120.0, *, token: str | None = None
) -> ControlReply:
    """Send ``request`` to the gateway at ``address`` (``HOST:PORT``); its reply.

    ``token``: whose request it is; ``None``: ``$NBOS_TOKEN``, else the operator token
    the gateway left for its own user (:func:`nbos.gateway.auth.client_token`). Raises
    :class:`TransportError` when no reply came within ``timeout`` seconds.
    """
    sent = client_token(address, token)
    reply = await _ask(address, Envelope(sent, request), timeout)
    if token is None and isinstance(reply, ControlError) and reply.kind == "unauthorized":
        # The gateway may have written its token file since (it had just started, or
        # restarted with another token): ask once more with the one it holds now.
        fresh = client_token(address)
        if fresh != sent:
            reply = await _ask(address, Envelope(fresh, request), timeout)
    return reply


#: How long one :class:`WatchKernel` of :func:`start_kernel` waits (the gateway answers
#: at once when the start ends).
_START_WATCH_S = 10.0


async def start_kernel(
    address: str,
    request: StartKernel,
    timeout: float = 300.0,
    *,
    token: str | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> ControlReply:
    """Start a kernel through the gateway at ``address`` and wait until it runs: its
    :class:`KernelInfo`, or the :class:`ControlError` of a start refused or failed.

    The start is asked with ``early=True``, so a start that waits for a host the
    autoscaler adds is answered at once (``on_wait(why)`` is called then, and again
    whenever why changes) and watched until it runs. A gateway from before ``early``
    (which refuses the field) is asked the plain start. Raises :class:`KernelError` when
    the kernel does not run within ``timeout`` seconds (its start is called off then),
    and :class:`TransportError` when the gateway does not answer.
    """
    deadline = time.monotonic() + timeout
    reply = await call(address, msgspec.structs.replace(request, early=True), timeout, token=token)
    if isinstance(reply, ControlError) and reply.kind == "malformed" and "early" in reply.message:
        reply = await call(
            address, msgspec.structs.replace(request, early=False), timeout, token=token
        )
    told = None
    while isinstance(reply, KernelInfo) and reply.state == "starting":
        if on_wait is not None and reply.waiting is not None and reply.waiting != told:
            told = reply.waiting
            on_wait(told)
        left = deadline - time.monotonic()
        if left <= 0:
            await call(address, ShutdownKernel(reply.kernel_id), _SHUTDOWN_TIMEOUT_S, token=token)
            raise KernelError(
                f"kernel {reply.kernel_id} still starts after {timeout:g} s ({reply.waiting})"
                "; its start was called off"
            )
        watch = WatchKernel(reply.kernel_id, min(left, _START_WATCH_S))
        reply = await call(address, watch, watch.wait_s + _SHUTDOWN_TIMEOUT_S, token=token)
    return reply


async def _ask(address: str, envelope: Envelope, timeout: float) -> ControlReply:
    ctx = zmq.asyncio.Context.instance()
    socket = ctx.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address if address.startswith("tcp://") else f"tcp://{address}")
    try:
        await socket.send(_encoder.encode(envelope))
        if not await socket.poll(int(timeout * 1000)):
            raise TransportError(f"no answer from the gateway at {address} in {timeout:g} s")
        reply: ControlReply = _replies.decode(await socket.recv())
        return reply
    finally:
        socket.close()
