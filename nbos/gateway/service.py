"""``nbos gateway``: the cluster's daemon: host directory, scheduler, every kernel, control API.

:class:`GatewayService` composes, on ``[gateway]`` settings:

* the gateway's endpoint at ``agent_address`` (CURVE with ``keys``) and its
  :class:`~nbos.gateway.HostDirectory`, which owns the one GPU scheduler;
* with ``local_agents``, ``[cluster] hosts`` ``nbos agent`` processes on this
  machine (127.0.0.1, ports of their own, ``[cluster] gpus_per_host`` virtual GPUs),
  started by the ``local`` host provider;
* with ``autoscale``, the :class:`~nbos.gateway._autoscale.LiveAutoscaler` adding
  hosts through ``host_provider`` and draining idle ones;
* the :class:`~nbos.cluster.Gateway` running every kernel over the
  :class:`~nbos.gateway.AgentBackend` (the same kernel code as ``LocalCluster``);
* the control endpoint at ``address`` (:mod:`nbos.gateway.control`).

Leaving it (SIGINT or SIGTERM for the command) shuts every kernel down, stops
the replicas still running and the providers' agents, in that order.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from nbos.agent import address_ip, tcp_address
from nbos.cluster import Gateway, Kernel, KernelOptions
from nbos.cluster._gpus import ClusterGpus
from nbos.core.config import GatewaySettings, Settings
from nbos.core.errors import ConfigError, TransportError
from nbos.core.host_provider import AgentCommand, HostProvider
from nbos.gateway import AgentBackend, HostDirectory
from nbos.gateway._autoscale import LiveAutoscaler
from nbos.gateway.control import (
    ClusterStatus,
    ControlReply,
    ControlRequest,
    HostState,
    HostStatus,
    KernelInfo,
    KernelList,
    ListKernels,
    ReplicaStatus,
    ShutdownKernel,
    StartKernel,
    StatusRequest,
    UsageRequest,
    serve_control,
)
from nbos.gateway.providers import LocalHostProvider, load_host_provider
from nbos.scaling import Autoscaler, AutoscalerConfig, ClusterDecisions
from nbos.transport import ZmqTransport
from nbos.transport.keys import KeyDirectory

log = logging.getLogger(__name__)

# How long local agents may take to register (each is a Python start).
_AGENTS_TIMEOUT_S = 120.0
# The autoscaler keys of [gateway], which only autoscale = true puts to use.
_AUTOSCALE_KEYS = (
    "min_hosts",
    "max_hosts",
    "autoscale_period_s",
    "scale_out_cooldown_s",
    "scale_in_cooldown_s",
    "idle_grace_s",
    "host_provider",
    "host_provider_options",
    "host_start_timeout_s",
)


class GatewayService:
    """One running ``nbos gateway``; build it with :meth:`serve`."""

    def __init__(
        self,
        directory: HostDirectory,
        gateway: Gateway,
        control_address: str,
        autoscaler: LiveAutoscaler | None = None,
    ) -> None:
        self.directory = directory
        self.gateway = gateway
        self.control_address = control_address
        #: The live autoscaler (``[gateway] autoscale``), else ``None``.
        self.autoscaler = autoscaler

    @classmethod
    @asynccontextmanager
    async def serve(cls, settings: Settings) -> AsyncIterator[GatewayService]:
        """Run the gateway on ``settings`` until the block exits."""
        conf = settings.gateway
        control = tcp_address(conf.address, "gateway.address")
        agents_at = tcp_address(conf.agent_address, "gateway.agent_address")
        if conf.missed_heartbeats < 1:
            raise ConfigError("gateway.missed_heartbeats", conf.missed_heartbeats, "at least 1")
        if not conf.heartbeat_s > 0:
            raise ConfigError("gateway.heartbeat_s", conf.heartbeat_s, "positive seconds")
        keys = KeyDirectory(conf.keys) if conf.keys else None
        scaling = _autoscaler_config(settings)
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
            transport = await stack.enter_async_context(
                await ZmqTransport.open(
                    "gateway", agents_at, curve=keys.gateway_curve() if keys else None
                )
            )
            directory = await stack.enter_async_context(
                HostDirectory.serve(
                    transport,
                    keys=keys,
                    policy=decisions,
                    replicas_per_kernel=settings.cluster.replicas_per_kernel,
                    heartbeat_interval=conf.heartbeat_s,
                    missed_heartbeats=conf.missed_heartbeats,
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
            )
            if provider is not None:
                stack.push_async_callback(_shielded_close, provider)
            if conf.local_agents:
                local = provider if isinstance(provider, LocalHostProvider) else None
                if local is None:
                    local = LocalHostProvider()
                    stack.push_async_callback(_shielded_close, local)
                for _ in range(settings.cluster.hosts):
                    await local.add_host(agent)
                await directory.wait_for_hosts(settings.cluster.hosts, _AGENTS_TIMEOUT_S)
            stack.push_async_callback(backend.aclose)
            options = KernelOptions(
                settings=settings, store=_store(settings, run_dir), front_ip=address_ip(control)
            )
            gateway = await stack.enter_async_context(
                Gateway.serve(ClusterGpus(None, directory.scheduler), backend, options)
            )
            socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            stack.callback(socket.close, 0)
            try:
                socket.bind(control)
            except zmq.ZMQError as exc:
                raise TransportError(f"cannot bind the control endpoint {control}: {exc}") from exc
            live = None
            if provider is not None:
                live = LiveAutoscaler(
                    directory,
                    gateway,
                    provider,
                    agent,
                    period=conf.autoscale_period_s,
                    host_timeout=conf.host_start_timeout_s,
                )
                # Stopped first on the way out: no host added or drained while kernels end.
                autoscaling = anyio.CancelScope()
                tg.start_soon(_run_in, autoscaling, live)
                stack.callback(autoscaling.cancel)
            service = cls(directory, gateway, control, live)
            tg.start_soon(serve_control, socket, service.handle)
            log.info("gateway: control at %s, agents at %s", control, transport.address)
            yield service

    # --- control -----------------------------------------------------------------

    async def handle(self, request: ControlRequest) -> ControlReply:
        match request:
            case StartKernel(gpus=gpus):
                return self.kernel_info(await self.gateway.start_kernel(gpus=gpus))
            case ListKernels():
                return KernelList([self.kernel_info(k) for k in self.gateway.kernels])
            case ShutdownKernel(kernel_id=kernel_id):
                await self.gateway.kernel(kernel_id).shutdown()
                return KernelList([self.kernel_info(k) for k in self.gateway.kernels])
            case StatusRequest():
                kernels = [self.kernel_info(k) for k in self.gateway.kernels]
                return ClusterStatus(self.host_status(), kernels)
            case UsageRequest():
                return self.directory.scheduler.ledger.usage()

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
        return KernelInfo(kernel.kernel_id, connection, replicas)

    def _replica_ip(self, kernel: Kernel, node: int) -> str:
        return str(self.gateway.replica_connection(kernel.kernel_id, node).get("ip", ""))

    def host_status(self) -> list[HostStatus]:
        out = []
        for host in self.directory.hosts():
            state: HostState = "vanished" if host.vanished else "up"
            try:
                counts = self.directory.scheduler.host(host.host_id).by_state()
            except KeyError:  # registered, no GPU report yet: placement cannot use it
                counts = {"idle": len(host.gpus)}
                state = "vanished" if host.vanished else "joining"
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


async def _run_in(scope: anyio.CancelScope, live: LiveAutoscaler) -> None:
    with scope:
        await live.run()


async def _shielded_close(provider: HostProvider) -> None:
    with anyio.CancelScope(shield=True):
        await provider.aclose()


def _autoscaler_config(settings: Settings) -> AutoscalerConfig | None:
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


async def run_until_signalled(settings: Settings) -> None:
    """Serve ``settings`` in the foreground until SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with GatewayService.serve(settings):
            async for signum in signals:
                log.info("gateway: %s, stopping", signal.strsignal(signum))
                return
