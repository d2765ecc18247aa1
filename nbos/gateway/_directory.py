"""The gateway's host directory: agents register over ZeroMQ (CURVE) and are watched.

The directory owns the gateway's one endpoint (peer id ``gateway``) and reads
every message once:

* ``AgentHello``: registration. With a key directory the hello's public key must
  be the one on file for its host; the directory then connects to the agent's
  address with that key as the CURVE server key (only the holder of the host's
  secret completes that handshake), admits the host to the scheduler and answers
  ``AgentWelcome``. Registration, and asking for it, are the only places that add
  agent peers.
* GPU replies and ``AgentStatus`` heartbeats go, undecoded, to the
  :class:`~nbos.gateway.GpuScheduler` through an inbox link.
* Replica replies go to the directory's request channel (:meth:`HostDirectory.call`);
  ``ReplicaExited`` goes to the listeners (the agent backend), then is acknowledged.
* ``AgentStatus`` from an agent that is not registered (it registered with this
  gateway's previous run, which was killed): the directory connects to the
  address it reports (with the host's key on file) and asks it for a hello.

Every message from an admitted agent counts as a sign of life. A host silent for
``missed_heartbeats`` heartbeat intervals is **suspected**, by the gateway's one failure
detector (:class:`~nbos.gateway._host_liveness.SilenceDetector`, which does not count
silence the gateway caused itself by being paused or starved): unschedulable, and its
listeners are told (the agent backend reports its replicas lost). A suspected host
that speaks again is asked for a hello and registers anew.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from nbos.agent import GATEWAY_PEER, address_ip, agent_peer, tcp_address
from nbos.core.errors import (
    ConfigError,
    DecodeError,
    HostUnreachableError,
    TransportClosedError,
    TransportError,
)
from nbos.core.ids import HostId, PeerId
from nbos.core.placement import PlacementPolicy
from nbos.core.wire import AnyMessage, decode, encode
from nbos.core.wire.agent import (
    AgentError,
    AgentHello,
    AgentHelloRequest,
    AgentLeaving,
    AgentReply,
    AgentStatus,
    AgentWelcome,
    GpuInfo,
    LeaveAdvice,
    ReplicaExitAck,
    ReplicaExited,
    ReplicaInfo,
    ReplicaReply,
    ReplicaRequest,
)
from nbos.gateway._host_liveness import SilenceDetector
from nbos.gateway._rpc import RequestChannel
from nbos.gateway._scheduler import GpuScheduler
from nbos.scaling import ClusterDecisions, FairShare, HostLimits
from nbos.transport import ZmqTransport
from nbos.transport.inbox import InboxLink
from nbos.transport.keys import KeyDirectory, check_host_name

log = logging.getLogger(__name__)

# Messages for the scheduler waiting to be read; beyond this they are dropped (retried).
_INBOX_SIZE = 4096
_RETRY_S = 0.25
# Replica requests are numbered apart from the scheduler's GPU requests on the same endpoint.
_FIRST_ID = 1 << 40


@attrs.define
class RegisteredHost:
    """One host whose agent registered: where it is, what it has, whether it is suspected."""

    host_id: HostId
    peer: PeerId
    address: str
    incarnation: str
    gpus: tuple[GpuInfo, ...]
    gpu_source: str
    suspected: bool = False

    @property
    def ip(self) -> str:
        """The address the host is reached at (replicas and their ports bind it)."""
        return address_ip(self.address)


class HostListener(Protocol):
    """Hears of hosts and replica exits (the agent backend)."""

    def host_registered(self, host: RegisteredHost, replicas: list[ReplicaInfo]) -> None:
        """``host`` (re)registered, holding ``replicas`` (live and unacknowledged ones)."""
        ...

    def host_suspected(self, host: RegisteredHost) -> None:
        """``host`` fell silent."""
        ...

    def replica_exited(self, host: HostId, replica: ReplicaInfo) -> None:
        """A replica process on ``host`` ended (acknowledged to the agent after this)."""
        ...


class HostDirectory:
    """The registered hosts and the scheduler over them; build it with :meth:`serve`."""

    def __init__(
        self,
        transport: ZmqTransport,
        keys: KeyDirectory | None,
        scheduler_inbox: MemoryObjectSendStream[tuple[PeerId, bytes]],
        *,
        heartbeat_interval: float,
        missed_heartbeats: int,
        rpc_timeout: float,
    ) -> None:
        self.transport = transport
        self._keys = keys
        self._scheduler_inbox = scheduler_inbox
        self._interval = heartbeat_interval
        self._silence = SilenceDetector(heartbeat_interval * missed_heartbeats)
        self._rpc = RequestChannel[ReplicaRequest, ReplicaReply](
            transport, timeout=rpc_timeout, retry_interval=_RETRY_S, first_id=_FIRST_ID
        )
        self._hosts: dict[HostId, RegisteredHost] = {}
        self._listeners: list[HostListener] = []
        self._changed = anyio.Event()
        self._scheduler: GpuScheduler | None = None
        # Unregistered agents asked for a hello, and when (see _ask_to_register).
        self._asked: dict[PeerId, float] = {}
        #: What an agent told to stop is answered (``nbos.gateway._leave``); by default:
        #: go, its replicas stay.
        self.leave_advice: Callable[[HostId, str], LeaveAdvice] = _go

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        transport: ZmqTransport,
        *,
        keys: KeyDirectory | None = None,
        policy: PlacementPolicy | ClusterDecisions | str = "least-loaded",
        replicas_per_kernel: int = 3,
        heartbeat_interval: float = 1.0,
        missed_heartbeats: int = 5,
        rpc_timeout: float = 5.0,
        limits: HostLimits | None = None,
        fair_share: FairShare | None = None,
    ) -> AsyncIterator[HostDirectory]:
        """Serve registrations on ``transport`` (peer id ``gateway``) until the block exits.

        ``keys``: admit only hosts with a public key there, over CURVE (the
        transport must have been opened with ``keys.gateway_curve()``); ``None``:
        admit any host, over plain TCP. ``heartbeat_interval`` is the agents'.
        ``limits``: what one host takes (the scheduler's placement keeps to them).
        ``fair_share``: the users' GPU quotas the scheduler keeps to (``None``: none).
        """
        if transport.local != GATEWAY_PEER:
            raise ConfigError("peer", transport.local, f"the gateway's peer id {GATEWAY_PEER!r}")
        if not heartbeat_interval > 0 or not rpc_timeout > 0:
            raise ConfigError("heartbeat_interval", heartbeat_interval, "positive seconds")
        if missed_heartbeats < 1:
            raise ConfigError("missed_heartbeats", missed_heartbeats, "at least 1")
        inbox_in, inbox_out = anyio.create_memory_object_stream[tuple[PeerId, bytes]](_INBOX_SIZE)
        directory = cls(
            transport,
            keys,
            inbox_in,
            heartbeat_interval=heartbeat_interval,
            missed_heartbeats=missed_heartbeats,
            rpc_timeout=rpc_timeout,
        )
        link = InboxLink(transport, inbox_out, {})
        async with (
            GpuScheduler.serve(
                link,
                policy,
                rpc_timeout=rpc_timeout,
                host_timeout=heartbeat_interval * missed_heartbeats,
                replicas_per_kernel=replicas_per_kernel,
                registered=True,
                limits=limits,
                fair_share=fair_share,
            ) as scheduler,
            # Closed only once the task group ended: a receive loop cancelled while it
            # holds a message would route it into a closed inbox.
            inbox_in,
            anyio.create_task_group() as tg,
        ):
            directory._scheduler = scheduler
            tg.start_soon(directory._receive_loop)
            tg.start_soon(directory._liveness_loop)
            try:
                yield directory
            finally:
                tg.cancel_scope.cancel()

    # --- queries -----------------------------------------------------------------

    @property
    def scheduler(self) -> GpuScheduler:
        assert self._scheduler is not None
        return self._scheduler

    def hosts(self) -> tuple[RegisteredHost, ...]:
        """Every host that registered, suspected ones included, by name."""
        return tuple(sorted(self._hosts.values(), key=lambda h: h.host_id))

    def live(self, host_id: HostId) -> RegisteredHost:
        """The registered, unsuspected ``host_id``; :class:`HostUnreachableError` otherwise."""
        host = self._hosts.get(host_id)
        if host is None:
            raise HostUnreachableError(host_id, "no agent registered")
        if host.suspected:
            raise HostUnreachableError(host_id, "its agent fell silent")
        return host

    def remove(self, host_id: HostId) -> None:
        """Forget a host that leaves the cluster (drained; its agent is being stopped):
        what it sends from now on is dropped, and its silence is nobody's failure."""
        host = self._hosts.pop(host_id, None)
        self._silence.forget(host_id)
        if host is not None:
            self.transport.remove_peer(host.peer)
        self.scheduler.remove_host(host_id)
        self._notify()

    async def tell(self, host_id: HostId, message: AnyMessage) -> None:
        """Send ``message`` to ``host_id``'s agent, if it is registered (no reply expected)."""
        host = self._hosts.get(host_id)
        if host is not None:
            await self._send(host.peer, message)

    def add_listener(self, listener: HostListener) -> None:
        self._listeners.append(listener)

    async def wait_for_hosts(self, n: int, timeout: float = 30.0) -> None:
        """Return once ``n`` hosts are registered and live; ``TimeoutError`` after ``timeout``."""
        with anyio.fail_after(timeout):
            while sum(not h.suspected for h in self._hosts.values()) < n:
                await self._changed.wait()
        await self.scheduler.wait_for_hosts(n, timeout)

    async def wait_live(self, host_id: HostId, timeout: float) -> bool:
        """Whether ``host_id`` is registered and live, waiting up to ``timeout`` for it."""
        with anyio.move_on_after(timeout):
            while True:
                host = self._hosts.get(host_id)
                if host is not None and not host.suspected:
                    return True
                await self._changed.wait()
        return False

    # --- requests ----------------------------------------------------------------

    async def call(
        self,
        host_id: HostId,
        make: Callable[[int], ReplicaRequest],
        timeout: float | None = None,
    ) -> ReplicaReply:
        """Send a replica request to ``host_id``'s agent (resent until answered); its reply.

        Raises :class:`HostUnreachableError` for a host that is not live or does not
        answer in time. An ``AgentError`` is returned like any reply.
        """
        host = self.live(host_id)
        return await self._rpc.call(host.peer, host_id, make, timeout)

    # --- loops -------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                sender, data = await self.transport.receive()
            except TransportClosedError:
                return
            try:
                message = decode(data)
            except DecodeError as exc:
                log.warning("gateway dropped a message from %s: %s", sender, exc)
                continue
            if isinstance(message, AgentHello):
                await self._on_hello(sender, message)
                continue
            host = self._sender_host(sender)
            if host is None and isinstance(message, AgentStatus):
                await self._ask_to_register(sender, message)
                continue
            if host is None:
                log.debug(
                    "%s from %s, not a registered agent: dropped", type(message).__name__, sender
                )
                continue
            self._silence.heard(host.host_id, anyio.current_time())
            if host.suspected:
                # Back after we gave up on it: register again (its replicas may be gone).
                await self._send(sender, AgentHelloRequest(0))
                continue
            await self._route(sender, host, message, data)

    async def _route(
        self, sender: PeerId, host: RegisteredHost, message: AnyMessage, data: bytes
    ) -> None:
        if isinstance(message, AgentReply):
            try:
                self._scheduler_inbox.send_nowait((sender, data))
            except anyio.WouldBlock:
                log.warning("scheduler messages pile up; dropped one from %s", sender)
        elif isinstance(message, ReplicaExited):
            for listener in self._listeners:
                listener.replica_exited(host.host_id, message.replica)
            await self._send(sender, ReplicaExitAck(message.replica.replica_id))
        elif isinstance(message, AgentLeaving):
            advice = self.leave_advice(host.host_id, message.incarnation)
            await self._send(sender, advice)
        elif isinstance(message, AgentError) and message.request_id is None:
            log.warning("host %s: %s (%s)", host.host_id, message.message, message.kind)
        elif isinstance(message, ReplicaReply):
            if not self._rpc.deliver(message.request_id or 0, message):
                log.debug("late or duplicate %s from %s", type(message).__name__, sender)
        else:
            log.warning("gateway dropped unexpected %s from %s", type(message).__name__, sender)

    async def _liveness_loop(self) -> None:
        while True:
            await anyio.sleep(self._silence.interval)
            for host_id, silence in self._silence.silent(anyio.current_time()):
                host = self._hosts.get(host_id)
                if host is not None and not host.suspected:
                    self._suspect(host, f"no word for {silence:.1f} s")

    # --- registration ------------------------------------------------------------

    async def _on_hello(self, sender: PeerId, hello: AgentHello) -> None:
        server_key = self._admissible(sender, hello)
        if server_key is None:
            return
        host_id = HostId(hello.host_id)
        known = self._hosts.get(host_id)
        now = anyio.current_time()
        try:
            # Re-adding at the same address and key keeps the connection.
            self.transport.add_peer(sender, hello.address, server_key=server_key or None)
        except TransportError as exc:
            log.warning("host %s: cannot connect to %s: %s", host_id, hello.address, exc)
            return
        host = self._hosts[host_id] = RegisteredHost(
            host_id, sender, hello.address, hello.incarnation, tuple(hello.gpus), hello.gpu_source
        )
        self._silence.heard(host_id, now)
        if known is None or known.suspected or known.incarnation != hello.incarnation:
            log.info(
                "host %s registered at %s: %d %s GPUs, %d replicas",
                host_id,
                hello.address,
                len(hello.gpus),
                hello.gpu_source,
                len(hello.replicas),
            )
        self.scheduler.admit(host_id, sender)
        self._asked.pop(sender, None)
        await self._send(sender, AgentWelcome(host_id, hello.incarnation))
        for listener in self._listeners:
            listener.host_registered(host, list(hello.replicas))
        self._notify()

    async def _ask_to_register(self, sender: PeerId, status: AgentStatus) -> None:
        """An agent that reports as registered, to a gateway that does not know it (this
        gateway restarted): connect to the address it reports and ask for its hello.

        With keys, the connection uses the host's key on file, so only that host's
        agent can complete it; its hello is then checked like any other. Asked at
        most once a heartbeat interval: an agent cut off from the gateway queued
        reports that all arrive at once.
        """
        now = anyio.current_time()
        if now - self._asked.get(sender, -self._interval) < self._interval:
            return
        try:
            check_host_name(status.host_id)
            tcp_address(status.address, "address")
        except ConfigError as exc:
            log.warning("status from %s dropped: %s", sender, exc)
            return
        if sender != agent_peer(status.host_id):
            log.warning("status of %s from peer %s dropped", status.host_id, sender)
            return
        try:
            key = self._keys.host_public(status.host_id) if self._keys is not None else b""
            self.transport.add_peer(sender, status.address, server_key=key or None)
        except (ConfigError, TransportError) as exc:
            log.warning("host %s cannot be asked to register: %s", status.host_id, exc)
            return
        level = logging.DEBUG if sender in self._asked else logging.INFO
        log.log(level, "host %s reports to us unregistered: asking for its hello", status.host_id)
        self._asked[sender] = now
        await self._send(sender, AgentHelloRequest(0))

    def _admissible(self, sender: PeerId, hello: AgentHello) -> bytes | None:
        """The CURVE server key to reach the agent with (``b""``: plain), or ``None``: refused."""
        try:
            check_host_name(hello.host_id)
            tcp_address(hello.address, "address")
        except ConfigError as exc:
            log.warning("hello from %s refused: %s", sender, exc)
            return None
        if sender != agent_peer(hello.host_id):
            log.warning("hello for %s from peer %s refused", hello.host_id, sender)
            return None
        if self._keys is None:
            return b""
        try:
            key = self._keys.host_public(hello.host_id)
        except ConfigError:
            log.warning("hello from host %s refused: no public key on file", hello.host_id)
            return None
        if hello.public_key.encode() != key:
            log.warning("hello from host %s refused: not the public key on file", hello.host_id)
            return None
        return key

    def _sender_host(self, sender: PeerId) -> RegisteredHost | None:
        host_id, _, role = sender.rpartition("/")
        host = self._hosts.get(HostId(host_id))
        if role != "agent" or host is None or host.peer != sender:
            return None
        return host

    def _suspect(self, host: RegisteredHost, why: str) -> None:
        host.suspected = True
        log.warning("host %s is suspected (%s): its replicas are reported lost", host.host_id, why)
        self.scheduler.host_suspected(host.host_id, why)
        for listener in self._listeners:
            listener.host_suspected(host)
        self._notify()

    async def _send(self, peer: PeerId, message: AnyMessage) -> None:
        try:
            await self.transport.send(peer, encode(message))
        except TransportError as exc:
            log.warning("gateway could not send to %s: %s", peer, exc)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


def _go(host: HostId, incarnation: str) -> LeaveAdvice:
    return LeaveAdvice(host, False, "no drain watch: replicas stay")
