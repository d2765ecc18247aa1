"""``nbos agent``: one host's daemon, serving its GPUs and replica processes to the gateway.

One ZeroMQ endpoint (peer id ``HOST/agent``) at the host's address carries
everything; with a key directory it speaks CURVE and admits only the gateway.
The daemon reads every message once and hands it on:

* GPU requests (:data:`~nbos.core.wire.agent.AgentRequest`) go to a
  :class:`~nbos.agent.HostAgent` serving the host's pool, through an
  :class:`~nbos.transport.inbox.InboxLink`, a ``Transport`` whose inbox the daemon fills;
* replica requests go to the :class:`~nbos.agent._replicas.ReplicaService`;
* registration (``AgentWelcome``, ``AgentHelloRequest``) and exit
  acknowledgements are handled here;
* undecodable bytes and messages an agent does not take are answered with
  ``AgentError`` and logged; messages from anyone but the gateway are logged and
  dropped (there is no way to answer them).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import anyio.abc
import attrs
import zmq.asyncio
from anyio.streams.memory import MemoryObjectSendStream

from nbos._version import __version__
from nbos.agent._agent import EVICT_TIMEOUT_S, HostAgent
from nbos.agent._join import join_gateway
from nbos.agent._replicas import ReplicaService, UnknownReplicaError
from nbos.agent._runtime import check_agent_settings
from nbos.core.config import AgentSettings
from nbos.core.errors import (
    BackendError,
    ConfigError,
    DecodeError,
    GpuError,
    TransportClosedError,
    TransportError,
)
from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.wire import AnyMessage, decode, encode
from nbos.core.wire.agent import (
    AgentError,
    AgentErrorKind,
    AgentHello,
    AgentHelloRequest,
    AgentLeaving,
    AgentRequest,
    AgentWelcome,
    GpuInfo,
    LeaveAdvice,
    PortsGranted,
    PortsRequest,
    ReplicaConnection,
    ReplicaConnectionRequest,
    ReplicaExitAck,
    ReplicaExited,
    ReplicaInfo,
    ReplicaList,
    ReplicaListRequest,
    ReplicaRequest,
    ReplicaSignal,
    ReplicaStart,
    ReplicaState,
    ReplicaStop,
)
from nbos.gpu import GpuPool, Inventory, discover_gpus
from nbos.kernel.jupyter_requests import control_request
from nbos.kernel.protocol import EVICT_DEVICES, EVICT_REQUEST
from nbos.transport import ZmqTransport
from nbos.transport.inbox import InboxLink
from nbos.transport.join import JoinToken, agent_key_pair, default_join_address
from nbos.transport.keys import KeyDirectory, check_host_name
from nbos.transport.ports import free_ports
from nbos.transport.zmq import CurveKeys

log = logging.getLogger(__name__)

#: The gateway's peer id: agents accept requests from this routing id only.
GATEWAY_PEER = PeerId("gateway")
#: How long a GPU pre-commit waits for its cell before the agent frees it.
DEFAULT_PRECOMMIT_TTL = 30.0
# GPU requests waiting for the HostAgent; beyond this they are dropped (the gateway retries).
_INBOX_SIZE = 1024
# Say once, loudly, when the gateway has not welcomed us for this long.
_UNWELCOMED_WARNING_S = 30.0
# SIGTERM to SIGKILL, for replicas stopped with the agent.
_STOP_GRACE = 5.0
# Told to stop, an agent that hears nothing from the gateway for this long goes.
_LEAVE_SILENCE_S = 5.0
_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")
# The most ports one request may ask for (a kernel's replica needs two).
_MAX_PORTS = 64


def address_ip(address: str) -> str:
    """The host part of a ``tcp://HOST:PORT`` address."""
    return address.removeprefix("tcp://").rpartition(":")[0]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def agent_peer(host: str) -> PeerId:
    """The peer id of host ``host``'s agent."""
    return PeerId(f"{host}/agent")


def tcp_address(value: str, key: str) -> str:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``) as a ZeroMQ address; wildcards are refused.

    The address is also what peers are told to connect to, so it must be one
    they can reach: a wildcard would tell them nothing.
    """
    address = value if value.startswith("tcp://") else f"tcp://{value}"
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or host in _WILDCARDS:
        raise ConfigError(key, value, "HOST:PORT with the address peers reach (no wildcard)")
    return address


@attrs.frozen
class AgentConfig:
    """What one ``nbos agent`` runs with (the command's options, ``[agent]`` as ``settings``)."""

    host_id: str
    address: str
    gateway_address: str
    state_dir: Path
    keys: Path | None = None
    virtual_gpus: int | None = None
    fallback_gpus: int = 8
    virtual_memory_mib: int = 40_960
    heartbeat_interval: float = 1.0
    precommit_ttl: float = DEFAULT_PRECOMMIT_TTL
    stop_replicas_on_exit: bool = False
    #: Without keys, listen on an address other hosts reach all the same.
    insecure: bool = False
    #: The gateway's join endpoint (``HOST:PORT``; empty: the port after ``gateway``'s),
    #: where an agent with ``settings.join_token_file`` joins.
    join_address: str = ""
    #: Built in code, an agent keeps no pre-started replicas unless told to.
    settings: AgentSettings = attrs.field(factory=lambda: AgentSettings(warm_replicas=0))

    def __attrs_post_init__(self) -> None:
        check_host_name(self.host_id)
        check_agent_settings(self.settings)
        tcp_address(self.address, "address")
        tcp_address(self.gateway_address, "gateway")
        if self.keys is not None and self.settings.join_token_file:
            raise ConfigError(
                "agent.join_token_file",
                self.settings.join_token_file,
                "no join token with --keys (a key pair from nbos keys, or a join token)",
            )
        if self.join_address and not self.settings.join_token_file:
            raise ConfigError("join_address", self.join_address, "a join token to join with")
        if self.settings.join_token_file:
            self.joins_at()
        secure = self.keys is not None or bool(self.settings.join_token_file)
        if not secure and not self.insecure and not _loopback(address_ip(self.address)):
            # Whoever reaches a keyless agent has it start any argv, as the agent's user.
            raise ConfigError(
                "address",
                self.address,
                "a loopback address without keys (--keys or a join token), or --insecure on a "
                "private network",
            )
        for key in ("heartbeat_interval", "precommit_ttl"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, getattr(self, key), "a positive number of seconds")

    def joins_at(self) -> str:
        """The join endpoint's ZeroMQ address (meaningful with a join token)."""
        if self.join_address:
            return tcp_address(self.join_address, "join_address")
        return default_join_address(tcp_address(self.gateway_address, "gateway"))

    async def curve(self) -> tuple[CurveKeys | None, bytes | None]:
        """This agent's CURVE keys and the gateway's public key (``None`` without keys);
        with a join token, once the gateway took the agent's own key."""
        if self.keys is not None:
            keys = KeyDirectory(self.keys)
            return keys.host_curve(self.host_id), keys.gateway_public()
        if not self.settings.join_token_file:
            return None, None
        token = JoinToken.read(self.settings.join_token_file)
        public, secret = agent_key_pair(self.state_dir)
        curve = CurveKeys(secret, public, frozenset({token.gateway_public}))
        await join_gateway(token, self.joins_at(), self.host_id, curve)
        return curve, token.gateway_public


class AgentDaemon:
    """One running ``nbos agent``; build it with :meth:`serve`."""

    def __init__(
        self,
        config: AgentConfig,
        transport: ZmqTransport,
        inventory: Inventory,
        public_key: bytes,
    ) -> None:
        self.config = config
        self.transport = transport
        self._inventory = inventory
        self._public_key = public_key.decode()
        self._welcomed: str | None = None
        self._advice: LeaveAdvice | None = None
        self._advised = anyio.Event()
        self._gpu: HostAgent | None = None
        self._replicas: ReplicaService | None = None
        self._zmq = zmq.asyncio.Context()

    @classmethod
    @asynccontextmanager
    async def serve(cls, config: AgentConfig) -> AsyncIterator[AgentDaemon]:
        """Run the agent until the block exits; replicas keep running unless configured."""
        curve, gateway_public = await config.curve()
        server_keys = {GATEWAY_PEER: gateway_public} if gateway_public is not None else {}
        inventory = await anyio.to_thread.run_sync(_discover, config)
        inbox_in, inbox_out = anyio.create_memory_object_stream[tuple[PeerId, bytes]](_INBOX_SIZE)
        async with await ZmqTransport.open(
            agent_peer(config.host_id), tcp_address(config.address, "address"), curve=curve
        ) as transport:
            daemon = cls(config, transport, inventory, curve.public_key if curve else b"")
            link = InboxLink(transport, inbox_out, server_keys)
            pool = GpuPool(inventory.indices, time.monotonic, config.precommit_ttl)
            gateway = tcp_address(config.gateway_address, "gateway")
            link.add_peer(GATEWAY_PEER, gateway)
            async with (
                anyio.create_task_group() as tg,
                HostAgent.serve(
                    config.host_id,
                    link,
                    pool,
                    gateway=GATEWAY_PEER,
                    gateway_address=gateway,
                    address=transport.address,
                    heartbeat_interval=config.heartbeat_interval,
                    on_evict=daemon._evict,
                    evict_timeout=EVICT_TIMEOUT_S,
                ) as gpu,
            ):
                daemon._gpu = gpu
                daemon._replicas = await ReplicaService.open(
                    HostId(config.host_id),
                    config.state_dir,
                    address_ip(transport.address),
                    daemon._report_exit,
                    tg,
                    settings=config.settings,
                )
                tg.start_soon(daemon._receive_loop, inbox_in, tg)
                tg.start_soon(daemon._heartbeat_loop)
                log.info(
                    "agent of host %s at %s (%d %s GPUs, replicas as %s), gateway %s",
                    config.host_id,
                    transport.address,
                    len(inventory.devices),
                    inventory.source,
                    "containers" if config.settings.runtime == "docker" else "processes",
                    gateway,
                )
                try:
                    yield daemon
                finally:
                    with anyio.CancelScope(shield=True):
                        await daemon._leave()
                        await daemon.replicas.detach()
                    tg.cancel_scope.cancel()
                    daemon._zmq.destroy(linger=0)

    # --- queries -----------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def incarnation(self) -> str:
        return self._agent.incarnation

    @property
    def welcomed(self) -> bool:
        """Whether the gateway took this incarnation's hello."""
        return self._welcomed == self.incarnation

    @property
    def _agent(self) -> HostAgent:
        assert self._gpu is not None
        return self._gpu

    @property
    def replicas(self) -> ReplicaService:
        assert self._replicas is not None
        return self._replicas

    def hello(self, request_id: int | None = None) -> AgentHello:
        return AgentHello(
            host_id=self.config.host_id,
            incarnation=self.incarnation,
            address=self.address,
            version=__version__,
            backend="docker" if self.config.settings.runtime == "docker" else "local",
            gpu_source=self._inventory.source,
            gpus=[
                GpuInfo(d.index, d.uuid, d.name, d.memory_total_mib)
                for d in self._inventory.devices
            ],
            public_key=self._public_key,
            replicas=self.replicas.infos(),
            request_id=request_id,
        )

    async def leave(self) -> None:
        """Told to stop (SIGTERM): return once the gateway says this agent may go
        (``nbos.gateway._leave``): at once, leaving the replicas running, unless the host's
        node is being drained; then once the gateway moved them off. An agent that runs no
        replica, stops its own, or is not registered goes at once; one whose gateway is
        silent for :data:`_LEAVE_SILENCE_S` goes then (a gateway that is down moves
        nothing)."""
        host = self.config.host_id
        holds = any(r.running for r in self.replicas.infos())
        if not self.welcomed or not holds or self.config.stop_replicas_on_exit:
            return  # nothing the gateway could move
        heard, said = anyio.current_time(), ""
        while anyio.current_time() - heard < _LEAVE_SILENCE_S:
            self._advised = anyio.Event()
            await self._send(AgentLeaving(host, self.incarnation))
            with anyio.move_on_after(self.config.heartbeat_interval):
                await self._advised.wait()
            advice = self._advice
            if not self._advised.is_set() or advice is None:
                continue
            heard = anyio.current_time()
            if advice.reason != said:
                said = advice.reason
                log.info(
                    "host %s stops: %s (%s)",
                    host,
                    advice.reason,
                    "waits" if advice.wait else "goes",
                )
            if not advice.wait:
                return
        log.warning("host %s: no word from the gateway for %g s: goes", host, _LEAVE_SILENCE_S)

    # --- loops -------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Say hello until welcomed; resend unacknowledged replica exits."""
        started = anyio.current_time()
        warned = False
        while True:
            if not self.welcomed:
                await self._send(self.hello())
                if not warned and anyio.current_time() - started > _UNWELCOMED_WARNING_S:
                    warned = True
                    log.warning(
                        "host %s: no welcome from the gateway at %s yet (is it up, and does it "
                        "hold this host's public key?)",
                        self.config.host_id,
                        self.config.gateway_address,
                    )
            await self.replicas.report_unacknowledged()
            await anyio.sleep(self.config.heartbeat_interval)

    async def _receive_loop(
        self, inbox: MemoryObjectSendStream[tuple[PeerId, bytes]], tg: anyio.abc.TaskGroup
    ) -> None:
        async with inbox:
            while True:
                try:
                    sender, data = await self.transport.receive()
                except TransportClosedError:
                    return
                if sender != GATEWAY_PEER:
                    log.warning("host %s dropped a message from %r", self.config.host_id, sender)
                    continue
                try:
                    message = decode(data)
                except DecodeError as exc:
                    await self._error("malformed", str(exc))
                    continue
                if isinstance(message, AgentRequest):
                    try:
                        inbox.send_nowait((sender, data))
                    except anyio.WouldBlock:
                        log.warning(
                            "host %s: GPU requests pile up, dropped one", self.config.host_id
                        )
                elif isinstance(message, ReplicaRequest):
                    # A stop waits for the process to end; nothing should wait behind it.
                    tg.start_soon(self._replica_request, message)
                else:
                    await self._control(message)

    # --- handlers ----------------------------------------------------------------

    async def _control(self, message: AnyMessage) -> None:
        match message:
            case AgentWelcome(host_id=host, incarnation=incarnation):
                if host == self.config.host_id and incarnation == self.incarnation:
                    if not self.welcomed:
                        log.info("host %s registered with the gateway", host)
                    self._welcomed = incarnation
                else:
                    log.info("welcome for %s/%s is not ours; ignored", host, incarnation)
            case AgentHelloRequest(request_id=rid):
                await self._send(self.hello(rid))
            case ReplicaExitAck(replica_id=replica_id):
                await self.replicas.acknowledge(replica_id)
            case LeaveAdvice(host_id=host) if host == self.config.host_id:
                self._advice = message
                self._advised.set()
            case _:
                request_id = getattr(message, "request_id", None)
                await self._error(
                    "unexpected",
                    f"an agent does not take {type(message).__name__}",
                    request_id if isinstance(request_id, int) else None,
                )

    async def _replica_request(self, message: ReplicaRequest) -> None:
        rid = message.request_id
        if isinstance(message, ReplicaListRequest):
            await self._send(ReplicaList(rid, self.replicas.infos(with_specs=message.with_specs)))
            return
        if isinstance(message, PortsRequest):
            await self._ports(message)
            return
        replica_id = message.replica_id
        reply: AnyMessage
        try:
            match message:
                case ReplicaStart(spec=spec):
                    reply = ReplicaState(rid, await self.replicas.start(replica_id, spec))
                case ReplicaSignal(signum=signum):
                    reply = ReplicaState(rid, await self.replicas.signal(replica_id, signum))
                case ReplicaStop(grace=grace):
                    reply = ReplicaState(rid, await self.replicas.stop(replica_id, grace))
                case ReplicaConnectionRequest():
                    info = await self.replicas.connection(replica_id)
                    reply = ReplicaConnection(rid, replica_id, info)
        except UnknownReplicaError as exc:
            await self._error("unknown_replica", str(exc), rid, replica_id)
        except ConfigError as exc:
            await self._error("invalid", str(exc), rid, replica_id)
        except BackendError as exc:
            await self._error("start_failed", str(exc), rid, replica_id)
        else:
            await self._send(reply)

    async def _ports(self, message: PortsRequest) -> None:
        """Ports free on this host's address, for replicas that are told them before binding."""
        if not 0 < message.count <= _MAX_PORTS:
            await self._error("invalid", f"ports: 1 to {_MAX_PORTS}", message.request_id)
            return
        ip = address_ip(self.address)
        try:
            ports = await anyio.to_thread.run_sync(free_ports, message.count, ip)
        except TransportError as exc:
            await self._error("invalid", str(exc), message.request_id)
            return
        await self._send(PortsGranted(message.request_id, ip, ports))

    async def _evict(self, kernel_id: KernelId, devices: tuple[int, ...]) -> None:
        """Have ``kernel_id``'s replica here move its tensors off ``devices``, which another
        kernel's cell is to get (lazy eviction); raises :class:`GpuError` if it does not."""
        for replica_id in self.replicas.of_kernel(kernel_id):
            info = await self.replicas.connection(replica_id)
            if not info:
                continue  # its kernel never bound its ports: it holds no tensors
            content = {EVICT_DEVICES: list(devices)}
            reply = await control_request(
                self._zmq, info, EVICT_REQUEST, content, timeout=EVICT_TIMEOUT_S
            )
            if reply is None or reply["content"].get("status") != "ok":
                why = "no answer" if reply is None else reply["content"].get("evalue", "refused")
                raise GpuError(f"replica {replica_id} did not move its tensors off: {why}")

    async def _report_exit(self, info: ReplicaInfo) -> None:
        await self._send(ReplicaExited(self.config.host_id, info))

    async def _error(
        self,
        kind: AgentErrorKind,
        message: str,
        request_id: int | None = None,
        replica_id: str = "",
    ) -> None:
        log.warning("host %s: %s (%s, request %s)", self.config.host_id, message, kind, request_id)
        await self._send(AgentError(kind, message, request_id, replica_id))

    async def _send(self, message: AnyMessage) -> None:
        try:
            await self.transport.send(GATEWAY_PEER, encode(message))
        except TransportError as exc:
            # Replies are retried by the gateway; hellos and exit reports repeat.
            log.warning("host %s could not reach the gateway: %s", self.config.host_id, exc)

    async def _leave(self) -> None:
        if self._replicas is not None:
            await self._replicas.close_warm()
        if self.config.stop_replicas_on_exit and self._replicas is not None:
            with anyio.move_on_after(2 * _STOP_GRACE):
                await self._replicas.stop_all(_STOP_GRACE)
        log.info("agent of host %s stopped", self.config.host_id)


@contextmanager
def _state_dir_lock(state_dir: Path) -> Iterator[None]:
    """``STATE/agent.lock``, held while the agent runs: two agents on one state directory
    would race over its replica records and adopt each other's replicas."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError("state_dir", str(state_dir), f"a writable directory ({exc})") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                "state_dir", str(state_dir), "a state directory no running agent uses"
            ) from None
        yield
    finally:
        os.close(fd)  # the lock goes with it (and with the process, however it ends)


def _discover(config: AgentConfig) -> Inventory:
    if config.virtual_gpus is not None:
        return discover_gpus(config.virtual_gpus, config.virtual_memory_mib, mode="virtual")
    return discover_gpus(config.fallback_gpus, config.virtual_memory_mib, mode="auto")


async def run_until_signalled(config: AgentConfig) -> None:
    """Serve ``config`` in the foreground until SIGINT or SIGTERM; another agent that runs
    on the same state directory is refused (:class:`ConfigError`) before anything starts."""
    with (
        _state_dir_lock(config.state_dir),
        anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        async with AgentDaemon.serve(config) as daemon:
            async for signum in signals:
                log.info("agent of host %s: %s, stopping", config.host_id, signal.strsignal(signum))
                if signum == signal.SIGTERM:
                    await _leave_unless_signalled(daemon, signals)
                return


async def _leave_unless_signalled(daemon: AgentDaemon, signals: AsyncIterator[int]) -> None:
    """:meth:`AgentDaemon.leave`, cut short by another signal (an operator's second ^C or
    ``kill``)."""
    async with anyio.create_task_group() as tg:

        async def cut_short() -> None:
            async for _ in signals:
                log.warning("agent of host %s: stops without waiting", daemon.config.host_id)
                tg.cancel_scope.cancel()

        tg.start_soon(cut_short)
        await daemon.leave()
        tg.cancel_scope.cancel()
