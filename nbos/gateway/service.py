"""``nbos gateway``: the cluster's daemon: host directory, scheduler, every kernel, control API.

:class:`GatewayService` composes, on ``[gateway]`` settings:

* the gateway's endpoint at ``agent_address`` (CURVE with ``keys``, and then each
  kernel's replicas with a key pair of the kernel's among themselves) and its
  :class:`~nbos.gateway.HostDirectory`, which owns the one GPU scheduler;
* with ``local_agents``, ``[cluster] hosts`` ``nbos agent`` processes on this
  machine (127.0.0.1, ports of their own, ``[cluster] gpus_per_host`` virtual GPUs),
  started by the ``local`` host provider;
* with ``autoscale``, the :class:`~nbos.gateway._autoscale.LiveAutoscaler` adding
  hosts through ``host_provider`` and draining idle ones;
* the :class:`~nbos.gateway.KernelManager` running every kernel over the
  :class:`~nbos.gateway.AgentBackend` (the same kernel code as ``LocalCluster``);
* the control endpoint at ``address`` (:mod:`nbos.gateway.control_api`), and the
  leases of kernels started with one (:mod:`nbos.gateway._leases`);
* with ``http_address``, the Jupyter Kernel Gateway REST and WebSocket API
  (:mod:`nbos.gateway.http`) that ``jupyter server --gateway-url`` speaks;
* with ``metrics_address``, Prometheus metrics there (:mod:`nbos.metrics.prometheus`).

With ``idle_exit_s``, :func:`run_until_signalled` also ends once the gateway has had
no kernel and no request for that long; with a runtime file
(:mod:`nbos.gateway.runtime`) it announces itself there.

Leaving it (SIGINT or SIGTERM for the command, an unexpected exception, the end of
the block) depends on the data dir. Without one it shuts every kernel down, stops
the replicas still running and the providers' agents (local agents included), in
that order. With one nothing is stopped and the state file is not written: kernels,
replicas and agents run on, for the gateway started next on the same data dir to take
back. Shutting them down is explicit: :class:`~nbos.gateway.control_api.ShutdownCluster`
(every kernel shut down, then the gateway exits as one without a data dir does) or
``shutdown_kernels_on_exit`` (``nbos gateway --shutdown-kernels-on-exit``).

With a ``[cluster] data_dir`` the gateway is durable: its kernels are kept in
``DATA_DIR/gateway/state.json`` (:mod:`nbos.gateway._state`), and a gateway
started again on the same settings after a crash or ``kill -9`` takes them back
(:meth:`~nbos.cluster.KernelManager.restore`): agents that report to it unregistered
are asked to register, local agents still running from the previous run (each
has a record ``DATA_DIR/agents/HOST.pid``, and runs in a session of its own, so
it outlives the gateway) are used instead of new ones, and each kernel's
replicas are adopted, its front bound on its old ports with its old key. Replicas
of no kernel it took back are stopped when its state says they were dropped, and
adopted when it never had their record (:mod:`nbos.gateway._strays`). Without
a data dir the gateway runs in a temporary directory and keeps nothing.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import attrs
import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from nbos.agent import address_ip, tcp_address
from nbos.core.config import AgentSettings, GatewaySettings, Settings
from nbos.core.errors import (
    ConfigError,
    ForbiddenError,
    IdentityProviderError,
    StateWriteError,
    TransportError,
    UnauthorizedError,
    UnknownKernelError,
)
from nbos.core.host_provider import AgentCommand, HostProvider
from nbos.core.identity import User
from nbos.core.ids import KernelId
from nbos.gateway._agent_backend import AgentBackend
from nbos.gateway._autoscale import LiveAutoscaler
from nbos.gateway._cluster_gpus import ClusterGpus
from nbos.gateway._control_starts import ControlStarts, starting_info
from nbos.gateway._dashboard import EventLog
from nbos.gateway._directory import HostDirectory
from nbos.gateway._hosts import HostRecord
from nbos.gateway._join import JoinSettings, gateway_join_token
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import KernelManager, KernelOptions, StartUnderWay
from nbos.gateway._kernel_state import KERNEL_STATES
from nbos.gateway._leases import KernelLeases
from nbos.gateway._leave import LeaveAdvisor
from nbos.gateway._state import GatewayState, StateFile
from nbos.gateway._strays import settle_strays
from nbos.gateway.auth import (
    Authenticator,
    UsersFile,
    acting_for,
    remove_token_file,
    write_token_file,
)
from nbos.gateway.control_api import (
    MAX_REQUEST_BYTES,
    ClusterStatus,
    ControlReply,
    ControlRequest,
    DigestRequest,
    HostState,
    HostStatus,
    KernelDigests,
    KernelInfo,
    KernelList,
    ListKernels,
    ReplicaStatus,
    RestartReplica,
    ShutdownCluster,
    ShutdownKernel,
    SignalReplica,
    StartKernel,
    StatusRequest,
    Usage,
    UsageRequest,
    WatchKernel,
    serve_control,
)
from nbos.gateway.http import DashboardSources, HttpApi, serve_http
from nbos.gateway.providers import LocalHostProvider, load_host_provider
from nbos.gateway.runtime import RuntimeFile
from nbos.metrics import Fanout, installed
from nbos.metrics.prometheus import (
    ClusterCollector,
    ClusterSample,
    PrometheusEvents,
    UserSample,
    serve_metrics,
)
from nbos.scaling import Autoscaler, AutoscalerConfig, ClusterDecisions, FairShare, HostLimits
from nbos.transport import ZmqTransport
from nbos.transport.join import default_join_address
from nbos.transport.keys import KeyDirectory

log = logging.getLogger(__name__)

# How long local agents may take to register (each is a Python start).
_AGENTS_TIMEOUT_S = 120.0
# A watch is answered after at most this long, so a lost client frees its slot.
_MAX_WATCH_S = 30.0
#: The control requests only an admin may make: they act on the whole cluster.
_ADMIN_REQUESTS = (UsageRequest, SignalReplica, RestartReplica, ShutdownCluster)
# Replies sent just before the gateway exits (ShutdownCluster's) still get out.
_REPLY_LINGER_MS = 1000
# The autoscaler keys of [gateway], which only autoscale = true puts to use.
_AUTOSCALE_KEYS = (
    "min_hosts",
    "max_hosts",
    "autoscale_period_s",
    "scale_out_cooldown_s",
    "scale_in_cooldown_s",
    "idle_grace_s",
    "spare_hosts",
    "host_provider",
    "host_provider_options",
    "precopy",
    "host_start_timeout_s",
)


@attrs.define
class _Exit:
    """What leaving the gateway stops: everything (``shut_down``), or nothing, for the
    gateway started next on the same data dir to take back."""

    shut_down: bool
    stack: AsyncExitStack

    def stop_on_exit(self, stop: Callable[[], Awaitable[None]]) -> None:
        """Run ``stop`` on the way out (in the stack's order) if shutting down."""
        self.stack.push_async_callback(self._stop, stop)

    async def _stop(self, stop: Callable[[], Awaitable[None]]) -> None:
        if self.shut_down:
            with anyio.CancelScope(shield=True):
                await stop()


class GatewayService:
    """One running ``nbos gateway``; build it with :meth:`serve`."""

    def __init__(
        self,
        directory: HostDirectory,
        kernel_manager: KernelManager,
        control_address: str,
        exit_plan: _Exit,
        *,
        authenticator: Authenticator,
        tg: anyio.abc.TaskGroup,
        autoscaler: LiveAutoscaler | None = None,
    ) -> None:
        self.directory = directory
        self.kernel_manager = kernel_manager
        self.control_address = control_address
        #: Whose each request's token is (every endpoint asks it).
        self.authenticator = authenticator
        self._exit = exit_plan
        #: Set by :class:`ShutdownCluster` once every kernel is shut down: the gateway
        #: is to exit (:func:`run_until_signalled` does).
        self.stop_requested = anyio.Event()
        self.leases = KernelLeases()
        #: The control API's starts answered before their kernel runs.
        self.starts = ControlStarts(kernel_manager, self.leases, tg)
        self._in_flight = 0
        self._last_activity = time.monotonic()
        #: The live autoscaler (``[gateway] autoscale``), else ``None``.
        self.autoscaler = autoscaler
        #: The Kernel Gateway API, when ``http_address`` is set.
        self.http: HttpApi | None = None
        #: Where each endpoint listens, by name (``control``, ``agents``, and ``metrics``
        #: and ``http`` when set): the ports bound, not the settings' 0s.
        self.addresses: dict[str, str] = {}

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, settings: Settings, *, shutdown_kernels_on_exit: bool = False
    ) -> AsyncIterator[GatewayService]:
        """Run the gateway on ``settings`` until the block exits.

        How the exit goes is in the module docstring: with a ``[cluster] data_dir``
        everything runs on unless ``shutdown_kernels_on_exit`` (or a
        :class:`ShutdownCluster` request) asked for every kernel to be shut down.
        """
        conf = settings.gateway
        control = tcp_address(conf.address, "gateway.address")
        agents_at = tcp_address(conf.agent_address, "gateway.agent_address")
        _check_values(conf)
        _check_addresses_free(conf)
        keys, joins = _keys(conf, agents_at)
        begun = anyio.current_time()
        scaling = autoscaler_config(settings)
        limits = HostLimits.of(settings.cluster)
        decisions = ClusterDecisions.load(
            settings.cluster.placement_policy,
            settings.cluster.replicas_per_kernel,
            Autoscaler(scaling) if scaling is not None else None,
        )
        provider: HostProvider | None = None
        if scaling is not None:
            provider = load_host_provider(conf.host_provider, **conf.host_provider_options)
        async with AsyncExitStack() as stack:
            run_dir = _run_dir(settings, stack)
            state = (
                StateFile(run_dir / "gateway" / "state.json") if settings.cluster.data_dir else None
            )
            exit_plan = _Exit(state is None or shutdown_kernels_on_exit, stack)
            authenticator = _operator(settings, run_dir, control, stack)
            # The dashboard's event log hears of hosts from their first registration on.
            event_log = stack.enter_context(installed(EventLog()))
            # Read first: a state file that does not decode stops the start, before
            # anything runs that would be orphaned.
            loaded = state.load() if state is not None else None
            transport = await _agent_endpoint(stack, agents_at, keys, joins)
            directory = await stack.enter_async_context(
                HostDirectory.serve(
                    transport,
                    keys=keys,
                    policy=decisions,
                    replicas_per_kernel=settings.cluster.replicas_per_kernel,
                    heartbeat_interval=conf.heartbeat_s,
                    missed_heartbeats=conf.missed_heartbeats,
                    limits=limits,
                    fair_share=_fair_share(settings, authenticator),
                )
            )
            tg = await stack.enter_async_context(anyio.create_task_group())
            backend = await AgentBackend.open(directory, tg)
            stack.callback(tg.cancel_scope.cancel)
            agent = AgentCommand(
                gateway=transport.address.removeprefix("tcp://"),
                gpus=settings.cluster.gpus_per_host,
                heartbeat_s=conf.heartbeat_s,
                keys=conf.keys,
                data_dir=str(run_dir),
                settings=str(_agent_settings_file(settings.agent, run_dir)),
            )
            if provider is not None:
                exit_plan.stop_on_exit(provider.aclose)
            if conf.local_agents:
                await _local_agents(settings.cluster.hosts, agent, provider, directory, exit_plan)
            exit_plan.stop_on_exit(backend.aclose)
            options = KernelOptions(
                settings=settings,
                store=_store(settings, run_dir),
                front_ip=address_ip(control),
                # A kernel's keys reach its replicas over the agent links: CURVE only if they are.
                curve=keys is not None,
            )
            kernel_manager = await stack.enter_async_context(
                KernelManager.serve(
                    ClusterGpus(None, directory.scheduler), backend, options, state=state
                )
            )
            # Before the manager's own exit, which with a state file leaves kernels running.
            exit_plan.stop_on_exit(kernel_manager.shutdown_kernels)
            if loaded is not None:
                await _take_back(loaded, kernel_manager, backend, conf)
            control_socket = _bind_control(control, stack)
            # Agents of an earlier run, or started elsewhere, may not have spoken yet.
            unheard = not conf.local_agents or (loaded is not None and loaded.generation > 0)
            live = await _autoscale_and_drain(
                conf,
                directory,
                kernel_manager,
                provider=provider,
                agent=agent,
                settle=conf.heartbeat_s * conf.missed_heartbeats if unheard else 0.0,
                tg=tg,
                stack=stack,
            )
            service = cls(
                directory,
                kernel_manager,
                control,
                exit_plan,
                authenticator=authenticator,
                tg=tg,
                autoscaler=live,
            )
            service.addresses["control"] = control.removeprefix("tcp://")
            service.addresses["agents"] = transport.address.removeprefix("tcp://")
            tg.start_soon(serve_control, control_socket, service.handle, authenticator.authenticate)
            tg.start_soon(service.expire_leases)
            await service._serve_http_endpoints(conf, tg, stack, event_log)
            log.info(
                "gateway: control at %s, agents at %s (ready in %.1f s)",
                control,
                transport.address,
                anyio.current_time() - begun,
            )
            yield service

    async def _serve_http_endpoints(
        self,
        conf: GatewaySettings,
        tg: anyio.abc.TaskGroup,
        stack: AsyncExitStack,
        event_log: EventLog,
    ) -> None:
        """The metrics and the Kernel Gateway API with its dashboard, where ``conf`` asks
        for them."""
        if conf.metrics_address:
            metrics_at = await _serve_metrics(self, conf.metrics_address, tg, stack, event_log)
            self.addresses["metrics"] = f"http://{metrics_at}/metrics"
        if conf.http_address:
            self.http = await stack.enter_async_context(
                serve_http(
                    conf,
                    self.kernel_manager,
                    self.max_host_gpus,
                    self.authenticator,
                    DashboardSources(self.host_status, event_log),
                )
            )
            self.addresses["http"] = self.http.url
            self.addresses["dashboard"] = f"{self.http.url}/dashboard/"

    # --- control -----------------------------------------------------------------

    async def handle(self, user: User, request: ControlRequest) -> ControlReply:
        self._in_flight += 1
        try:
            return await self._answer(user, request)
        finally:
            self._in_flight -= 1
            self._last_activity = time.monotonic()

    async def _answer(self, user: User, request: ControlRequest) -> ControlReply:
        if isinstance(request, _ADMIN_REQUESTS) and not user.is_admin:
            raise ForbiddenError(f"{type(request).__name__} is for admins, and {user.name} is none")
        match request:
            case StartKernel(
                gpus=gpus, connection=connection, lease_s=lease_s, user=owner, early=True
            ):
                started = await self.starts.start(
                    gpus=gpus, connection=connection, lease_s=lease_s, owner=acting_for(user, owner)
                )
                if isinstance(started, StartUnderWay):
                    return starting_info(started)
                return self.kernel_info(started)
            case StartKernel(gpus=gpus, connection=connection, lease_s=lease_s, user=owner):
                kernel = await self.kernel_manager.start_kernel(
                    gpus=gpus, connection=connection, owner=acting_for(user, owner)
                )
                if lease_s is not None:
                    self.leases.grant(kernel.kernel_id, lease_s)
                return self.kernel_info(kernel)
            case WatchKernel(kernel_id=kernel_id, wait_s=wait_s):
                start = await self.starts.watch(user, kernel_id, min(wait_s, _MAX_WATCH_S))
                if start is not None:
                    return starting_info(start)
                kernel = self.kernel_of(user, kernel_id)
                with self.leases.watched(kernel_id):
                    with anyio.move_on_after(min(wait_s, _MAX_WATCH_S)):
                        await kernel.closed.wait()
                return self.kernel_info(self.kernel_of(user, kernel_id))
            case ListKernels(starts=starts):
                return KernelList(self.kernel_infos(user, starts=starts))
            case ShutdownKernel(kernel_id=kernel_id):
                if not self.starts.shut_down(user, kernel_id):
                    await self.kernel_of(user, kernel_id).shutdown()
                return KernelList(self.kernel_infos(user))
            case ShutdownCluster():
                await self.shut_down()
                return KernelList(self.kernel_infos(user))
            case StatusRequest(starts=starts):
                return ClusterStatus(self.host_status(), self.kernel_infos(user, starts=starts))
            case UsageRequest():
                return Usage.of(self.directory.scheduler.ledger)
            case SignalReplica(kernel_id=kernel_id, node=node, signal=signum):
                kernel = self.kernel_of(user, kernel_id)
                await kernel.signal_replica(node, _signal_number(signum))
                return self.kernel_info(kernel)
            case RestartReplica(kernel_id=kernel_id, node=node, timeout_s=timeout_s):
                kernel = self.kernel_of(user, kernel_id)
                await kernel.restart_replica(node, timeout=timeout_s)
                return self.kernel_info(kernel)
            case DigestRequest(kernel_id=kernel_id, after=after, timeout_s=timeout_s):
                kernel = self.kernel_of(user, kernel_id)
                after = kernel.front.last_exec_index if after is None else after
                return KernelDigests(after, await kernel.digests(after=after, timeout=timeout_s))

    def kernel_of(self, user: User, kernel_id: str) -> Kernel:
        """``user``'s kernel ``kernel_id``; :class:`UnknownKernelError` if there is none, as
        if another's did not exist."""
        kernel = self.kernel_manager.kernel(kernel_id)
        if not user.may_see(kernel.owner):
            raise UnknownKernelError(KernelId(kernel_id))
        return kernel

    def kernel_infos(self, user: User, *, starts: bool = False) -> list[KernelInfo]:
        """What ``user`` may see of the kernels: their own, or all for an admin; with
        ``starts``, then the starts under way (``starting``, with why while they wait)."""
        manager = self.kernel_manager
        infos = [self.kernel_info(k) for k in manager.kernels if user.may_see(k.owner)]
        if starts:
            infos += [starting_info(s) for s in manager.starts if user.may_see(s.owner)]
        return infos

    async def shut_down(self) -> None:
        """Shut every kernel down, and have the gateway exit, stopping all it runs."""
        log.info("gateway: asked to shut the cluster down: every kernel, then the gateway")
        self._exit.shut_down = True
        await self.kernel_manager.shutdown_kernels()
        self.stop_requested.set()

    async def expire_leases(self) -> None:
        """Shut down, forever, the kernels whose lease ran out (their owner died)."""
        while True:
            interval = self.leases.check_interval()
            await anyio.sleep(interval)
            for kernel_id in self.leases.expired(interval):
                kernel = next(
                    (k for k in self.kernel_manager.kernels if k.kernel_id == kernel_id), None
                )
                if kernel is not None:
                    log.warning("kernel %s: its owner stopped watching it: shut down", kernel_id)
                    try:
                        await kernel.retire()
                    except StateWriteError as exc:
                        # Its lease stays run out: the next check tries again.
                        log.warning("kernel %s runs on: %s", kernel_id, exc)
                        continue
                self.leases.forget(kernel_id)
                if kernel is not None:
                    await kernel.shutdown()

    def idle_for(self) -> float:
        """Seconds since the gateway last had a kernel or a request (0 while it has)."""
        now = time.monotonic()
        if self._in_flight or self.kernel_manager.kernels:
            self._last_activity = now
        return now - self._last_activity

    def kernel_info(self, kernel: Kernel) -> KernelInfo:
        connection = {
            k: v.decode() if isinstance(v, bytes) else v
            for k, v in kernel.connection_info.items()
            if isinstance(v, str | int | bytes)
        }
        replicas = [
            ReplicaStatus(r.node, r.host, self._replica_ip(kernel, r.node), r.pid, r.alive)
            for r in kernel.replicas
        ]
        front = kernel.front
        terms = self.kernel_manager.terms(kernel.kernel_id)
        return KernelInfo(
            kernel.kernel_id,
            connection,
            replicas,
            running_on=front.running_on,
            last_executor=front.last_executor,
            last_exec_index=front.last_exec_index,
            state=kernel.state,
            owner=kernel.owner,
            api_id=self.http.kernels.api_id(kernel.kernel_id) if self.http else None,
            gpus=terms[0] if terms else None,
            started_at=terms[1] if terms else None,
        )

    def _replica_ip(self, kernel: Kernel, node: int) -> str:
        return str(self.kernel_manager.replica_connection(kernel.kernel_id, node).get("ip", ""))

    def metrics_sample(self) -> ClusterSample:
        """The gauges of ``/metrics``: GPUs by state per host, kernels by state, live
        replicas."""
        gpus = {
            h.host_id: {
                "idle": h.idle,
                "precommitted": h.precommitted,
                "committed": h.committed,
                "resident": h.resident,
            }
            for h in self.host_status()
        }
        kernels = self.kernel_manager.kernels
        alive = sum(r.alive for k in kernels for r in k.replicas)
        by_state = Counter(k.state for k in kernels)
        states: dict[str, int] = {s: by_state[s] for s in KERNEL_STATES}
        return ClusterSample(gpus, states, alive, self.user_samples())

    def user_samples(self) -> dict[str, UserSample]:
        """Each user's figures (``/metrics``): every user who ever had a kernel here."""
        owners = self.kernel_manager.owners
        scheduler = self.directory.scheduler
        kernels = Counter(k.owner for k in self.kernel_manager.kernels)
        waiting = Counter(owners.get(k, "") for k, _ in scheduler.waiting())
        held = scheduler.user_gpus()
        seconds: dict[str, float] = {}
        now = scheduler.ledger.now()
        for cell in scheduler.ledger.cells():
            if cell.started is not None:
                user = owners.get(KernelId(cell.kernel_id), "")
                end = now if cell.ended is None else cell.ended
                seconds[user] = seconds.get(user, 0.0) + cell.gpus * (end - cell.started)
        return {
            user: UserSample(kernels[user], waiting[user], held.get(user, 0), seconds.get(user, 0))
            for user in set(owners.values()) | set(held)
        }

    async def may_read_metrics(self, token: str) -> bool:
        """Whether ``token`` is an admin's (once users may sign in, the metrics are theirs)."""
        try:
            return (await self.authenticator.authenticate(token)).is_admin
        except (UnauthorizedError, IdentityProviderError) as exc:
            log.warning("metrics: %s", exc)
            return False

    def max_host_gpus(self) -> int:
        """The GPU count of the largest host that is up (the kernelspecs offered)."""
        return max((len(h.gpus) for h in self.directory.hosts() if not h.suspected), default=0)

    def host_status(self) -> list[HostStatus]:
        out = []
        for host in self.directory.hosts():
            try:
                record: HostRecord | None = self.directory.scheduler.host(host.host_id)
            except KeyError:  # registered, no GPU report yet: placement cannot use it
                record = None
            # Silence suspects a host in the directory, an unanswered request in the scheduler.
            suspected = host.suspected or (record is not None and record.suspected)
            state: HostState = "suspected" if suspected else "joining" if record is None else "up"
            counts = record.by_state() if record is not None else {"idle": len(host.gpus)}
            out.append(
                HostStatus(
                    host.host_id,
                    host.address,
                    state,
                    len(host.gpus),
                    counts.get("idle", 0),
                    counts.get("precommitted", 0),
                    counts.get("committed", 0),
                    counts.get("resident", 0),
                )
            )
        return out


async def _take_back(
    loaded: GatewayState,
    kernel_manager: KernelManager,
    backend: AgentBackend,
    conf: GatewaySettings,
) -> None:
    """The kernels of the state file, then the replicas no record names (``settle_strays``)."""
    # A host silent for this long would be suspected anyway.
    wait_s = conf.heartbeat_s * conf.missed_heartbeats
    if loaded.kernels:
        restored = await kernel_manager.restore(loaded.kernels, wait_s)
        log.info("gateway: %d of %d kernels taken back", len(restored), len(loaded.kernels))
    await settle_strays(backend, kernel_manager, loaded, wait_s)


def _signal_number(value: int) -> signal.Signals:
    try:
        return signal.Signals(value)
    except ValueError:
        raise ConfigError("signal", value, "a signal number of this platform") from None


async def _serve_metrics(
    service: GatewayService,
    address: str,
    tg: anyio.abc.TaskGroup,
    stack: AsyncExitStack,
    event_log: EventLog,
) -> str:
    """Count this process's events (the event log still hearing of them) and serve them,
    with the service's gauges, at ``address``; the ``HOST:PORT`` bound."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ClusterCollector(service.metrics_sample))
    stack.enter_context(installed(Fanout([event_log, PrometheusEvents(registry)])))
    # Once users may sign in, the cluster's figures are the operators'.
    authorize = service.may_read_metrics if service.authenticator.has_users else None
    bound: str = await tg.start(partial(serve_metrics, address, registry, authorize=authorize))
    return bound


def _run_dir(settings: Settings, stack: AsyncExitStack) -> Path:
    """``[cluster] data_dir``, or a temporary directory removed at the end."""
    if settings.cluster.data_dir:
        path = Path(settings.cluster.data_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix="nbos-gateway-"))
    stack.callback(shutil.rmtree, path, True)
    return path


def _store(settings: Settings, run_dir: Path) -> str:
    """What replicas get as ``--store``: Redis for many machines, else a shared directory."""
    if settings.store.kind == "redis":
        return settings.store.redis_url
    return settings.store.path or str(run_dir / "store")


def _check_addresses_free(conf: GatewaySettings) -> None:
    """:class:`ConfigError` naming the setting whose address another process listens on,
    before anything starts (no agent started only to be stopped again).

    A test bind, as the endpoints themselves bind (``SO_REUSEADDR``: a port that only
    lingers in ``TIME_WAIT`` is free). One that a process takes between this check and the
    endpoint's own bind is still refused there, as a :class:`TransportError`.
    """
    for key in ("address", "agent_address", "http_address", "metrics_address"):
        value: str = getattr(conf, key)
        host, sep, port = value.removeprefix("tcp://").rpartition(":")
        if not value or not sep or not port.isdigit():
            continue  # unset, or malformed: refused with its own message where it is used
        refused = _listen_refused(host.removeprefix("[").removesuffix("]"), int(port))
        if refused is not None:
            raise ConfigError(f"gateway.{key}", value, f"an address free to listen on: {refused}")


def _listen_refused(host: str, port: int) -> str | None:
    """Why listening at ``host:port`` fails now, or ``None`` if it would not."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(where)
            probe.listen(1)
    except (OSError, UnicodeError) as exc:
        return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    return None


async def _agent_endpoint(
    stack: AsyncExitStack, address: str, keys: KeyDirectory | None, joins: JoinSettings | None
) -> ZmqTransport:
    """The gateway's endpoint for agents (CURVE with keys), and its join endpoint."""
    curve = keys.gateway_curve() if keys else None
    transport = await stack.enter_async_context(
        await ZmqTransport.open("gateway", address, curve=curve)
    )
    if joins is not None:
        await stack.enter_async_context(joins.serve(transport))
    return transport


def _keys(conf: GatewaySettings, agents_at: str) -> tuple[KeyDirectory | None, JoinSettings | None]:
    """The key directory and the join endpoint's settings, checked (``None``: none)."""
    keys = KeyDirectory(conf.keys) if conf.keys else None
    return keys, _join_settings(conf, keys, agents_at)


_ENGINE_SCHEMES = ("unix", "tcp", "http", "https")


def _join_settings(
    conf: GatewaySettings, keys: KeyDirectory | None, agents_at: str
) -> JoinSettings | None:
    if not conf.join_token_file:
        if conf.join_address:
            raise ConfigError("gateway.join_address", conf.join_address, "a join_token_file")
        return None
    if keys is None:
        raise ConfigError("gateway.keys", conf.keys, "a key directory, with join_token_file")
    token = gateway_join_token(keys, conf.join_token_file)
    if conf.join_address:
        return JoinSettings(tcp_address(conf.join_address, "gateway.join_address"), keys, token)
    return JoinSettings(default_join_address(agents_at), keys, token)


def _check_values(conf: GatewaySettings) -> None:
    """:class:`ConfigError` for the first ``[gateway]`` value that cannot take effect."""
    _check_timing(conf)
    if conf.swarm_engine and conf.swarm_engine.partition("://")[0] not in _ENGINE_SCHEMES:
        raise ConfigError("gateway.swarm_engine", conf.swarm_engine, "a unix:// or tcp:// URL")


def _check_timing(conf: GatewaySettings) -> None:
    if conf.missed_heartbeats < 1:
        raise ConfigError("gateway.missed_heartbeats", conf.missed_heartbeats, "at least 1")
    if not conf.heartbeat_s > 0:
        raise ConfigError("gateway.heartbeat_s", conf.heartbeat_s, "positive seconds")
    if not conf.idle_exit_s >= 0:
        raise ConfigError("gateway.idle_exit_s", conf.idle_exit_s, "seconds, 0 for never")


async def _local_agents(
    hosts: int,
    agent: AgentCommand,
    provider: HostProvider | None,
    directory: HostDirectory,
    exit_plan: _Exit,
) -> None:
    """``hosts`` agents on this machine, through the ``local`` provider (the autoscaler's,
    if that is the one it uses), registered before this returns; those an earlier
    gateway on the same data dir left running are used again."""
    local = provider if isinstance(provider, LocalHostProvider) else None
    if local is None:
        local = LocalHostProvider()
        exit_plan.stop_on_exit(local.aclose)
    for _ in range(hosts):
        await local.add_host(agent)
    await directory.wait_for_hosts(hosts, _AGENTS_TIMEOUT_S)


def _fair_share(settings: Settings, authenticator: Authenticator) -> FairShare | None:
    """The users' GPU quotas the scheduler keeps to; ``None`` (first come, first served)
    while nobody but the operator may sign in."""
    if not authenticator.has_users:
        return None
    files = [p for p in authenticator.providers if isinstance(p, UsersFile)]
    return FairShare(files[0].quotas if files else {}, settings.auth.default_quota)


def _operator(
    settings: Settings, run_dir: Path, control: str, stack: AsyncExitStack
) -> Authenticator:
    """The gateway's authenticator (a durable gateway keeps its operator token in its data
    dir), the token in its file until the gateway exits (written before the control
    endpoint is bound: no client finds it without the file)."""
    durable = run_dir / "gateway" / "operator.token" if settings.cluster.data_dir else None
    authenticator = Authenticator.of(settings, durable)
    token = authenticator.operator_token
    path = write_token_file(control, token)
    stack.callback(remove_token_file, path, token)
    return authenticator


def _bind_control(control: str, stack: AsyncExitStack) -> zmq.asyncio.Socket:
    bound = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    stack.callback(bound.close, _REPLY_LINGER_MS)
    bound.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # before bind: listeners copy it
    try:
        bound.bind(control)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind the control endpoint {control}: {exc}") from exc
    return bound


async def _autoscale_and_drain(
    conf: GatewaySettings,
    directory: HostDirectory,
    kernel_manager: KernelManager,
    *,
    provider: HostProvider | None,
    agent: AgentCommand,
    settle: float,
    tg: anyio.abc.TaskGroup,
    stack: AsyncExitStack,
) -> LiveAutoscaler | None:
    """The live autoscaler (with a provider; its first decision ``settle`` seconds on at
    the earliest) and what agents told to stop are answered: with ``swarm_engine``, a host
    whose swarm node is drained is emptied first."""
    live = None
    if provider is not None:
        live = LiveAutoscaler(
            directory,
            kernel_manager,
            provider,
            agent,
            period=conf.autoscale_period_s,
            host_timeout=conf.host_start_timeout_s,
            settle=settle,
            precopy=conf.precopy,
        )
        _run_autoscaler(live, tg, stack)
    nodes = None
    if conf.swarm_engine:
        from nbos.backends.swarm import SwarmNodes

        nodes = SwarmNodes(conf.swarm_engine)
        stack.push_async_callback(nodes.aclose)
    # Its own task group, ended before the kernels: no drain runs while they shut down.
    drains = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(drains.cancel_scope.cancel)
    advisor = LeaveAdvisor(
        directory,
        kernel_manager,
        nodes,
        drains,
        period=conf.autoscale_period_s,
        busy=(lambda h: h in live.draining) if live is not None else (lambda _: False),
    )
    directory.leave_advice = advisor.advise
    return live


def _run_autoscaler(live: LiveAutoscaler, tg: anyio.abc.TaskGroup, stack: AsyncExitStack) -> None:
    # Stopped first on the way out: no host added or drained while kernels end.
    autoscaling = anyio.CancelScope()
    tg.start_soon(_run_in, autoscaling, live)
    stack.callback(autoscaling.cancel)


async def _run_in(scope: anyio.CancelScope, live: LiveAutoscaler) -> None:
    with scope:
        await live.run()


def autoscaler_config(settings: Settings) -> AutoscalerConfig | None:
    """The autoscaler ``[gateway]`` asks for, or ``None``; :class:`ConfigError` for bad keys
    and for autoscaler keys set without ``autoscale`` (they would do nothing)."""
    conf = settings.gateway
    if not conf.autoscale:
        default = GatewaySettings()
        for key in _AUTOSCALE_KEYS:
            if getattr(conf, key) != getattr(default, key):
                raise ConfigError(f"gateway.{key}", getattr(conf, key), "gateway.autoscale = true")
        return None
    for key in ("autoscale_period_s", "host_start_timeout_s"):
        value = getattr(conf, key)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"gateway.{key}", value, "positive seconds")
    try:
        return AutoscalerConfig(
            min_hosts=conf.min_hosts,
            max_hosts=conf.max_hosts,
            scale_out_cooldown=conf.scale_out_cooldown_s,
            scale_in_cooldown=conf.scale_in_cooldown_s,
            idle_grace=conf.idle_grace_s,
            new_host_gpus=settings.cluster.gpus_per_host,
            spare_hosts=conf.spare_hosts,
        )
    except ConfigError as exc:
        key = {
            "scale_out_cooldown": "scale_out_cooldown_s",
            "scale_in_cooldown": "scale_in_cooldown_s",
            "idle_grace": "idle_grace_s",
            "new_host_gpus": "cluster.gpus_per_host",
        }.get(exc.key, exc.key)
        key = key if key.startswith("cluster.") else f"gateway.{key}"
        raise ConfigError(key, exc.value, exc.expected) from exc


async def run_until_signalled(
    settings: Settings,
    runtime_file: Path | None = None,
    *,
    shutdown_kernels_on_exit: bool = False,
    on_ready: Callable[[GatewayService], None] | None = None,
) -> None:
    """Serve ``settings`` in the foreground until SIGINT or SIGTERM, a
    :class:`ShutdownCluster` request, or until idle for ``[gateway] idle_exit_s``;
    announced in ``runtime_file`` meanwhile, if given, and to ``on_ready`` once every
    endpoint listens (``nbos gateway`` prints its ready line there). The exit leaves
    kernels running where :meth:`GatewayService.serve` says."""
    runtime = RuntimeFile(runtime_file) if runtime_file is not None else None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with GatewayService.serve(
            settings, shutdown_kernels_on_exit=shutdown_kernels_on_exit
        ) as service:
            try:
                if runtime is not None:
                    runtime.write(service.control_address.removeprefix("tcp://"))
                if on_ready is not None:
                    on_ready(service)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_until_signalled, signals, tg.cancel_scope)
                    tg.start_soon(_until_set, service.stop_requested, tg.cancel_scope)
                    if settings.gateway.idle_exit_s > 0:
                        await _until_idle(service, settings.gateway.idle_exit_s, runtime)
                        tg.cancel_scope.cancel()
            finally:
                if runtime is not None:
                    runtime.remove_if_mine()


async def _until_signalled(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
    async for signum in signals:
        log.info("gateway: %s, stopping", signal.strsignal(signum))
        scope.cancel()
        return


async def _until_set(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _until_idle(service: GatewayService, idle_s: float, runtime: RuntimeFile | None) -> None:
    """Return once the gateway was idle for ``idle_s``; no client is then told its address."""
    while True:
        await anyio.sleep(min(1.0, idle_s / 4))
        if service.idle_for() < idle_s:
            continue
        if runtime is None:
            break
        # A client that holds the lock is about to use this gateway: look again later.
        with runtime.locked(block=False) as held:
            if held and service.idle_for() >= idle_s:
                runtime.remove_if_mine()
                break
    log.info("gateway: no kernel for %g s, stopping", idle_s)


def _agent_settings_file(agent: AgentSettings, run_dir: Path) -> Path:
    """The gateway's ``[agent]`` table as a settings file, for its local agents.

    Its values are strings, numbers and lists of strings, whose JSON form is valid TOML;
    TOML has no null, so a key left unset is left out.
    """
    lines = ["[agent]"]
    for key, value in msgspec.to_builtins(agent).items():
        if value is not None:
            lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    path = run_dir / "agent.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
