"""``nbos gateway``: the cluster's daemon: host directory, scheduler, every kernel, control API.

:class:`GatewayService` composes, on ``[gateway]`` settings:

* the gateway's endpoint at ``agent_address`` (CURVE with ``keys``) and its
  :class:`~nbos.gateway.HostDirectory`, which owns the one GPU scheduler;
* with ``local_agents``, ``[cluster] hosts`` ``nbos agent`` processes on this
  machine (127.0.0.1, ports of their own, ``[cluster] gpus_per_host`` virtual GPUs);
* the :class:`~nbos.cluster.Gateway` running every kernel over the
  :class:`~nbos.gateway.AgentBackend` (the same kernel code as ``LocalCluster``);
* the control endpoint at ``address`` (:mod:`nbos.gateway.control`);
* with ``http_address``, the Jupyter Kernel Gateway REST and WebSocket API
  (:mod:`nbos.gateway.http`) that ``jupyter server --gateway-url`` speaks.

Leaving it (SIGINT or SIGTERM for the command) shuts every kernel down, stops
the replicas still running and the local agents, in that order.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from nbos.agent import address_ip, tcp_address
from nbos.cluster import Gateway, Kernel, KernelOptions
from nbos.cluster._gpus import ClusterGpus
from nbos.core.config import Settings
from nbos.core.errors import ConfigError, TransportError
from nbos.gateway import AgentBackend, HostDirectory
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
    serve_control,
)
from nbos.gateway.http import HttpApi, serve_http
from nbos.transport import ZmqTransport
from nbos.transport.keys import KeyDirectory

log = logging.getLogger(__name__)

# How long local agents may take to register (each is a Python start).
_AGENTS_TIMEOUT_S = 120.0
_AGENT_STOP_S = 15.0


class GatewayService:
    """One running ``nbos gateway``; build it with :meth:`serve`."""

    def __init__(self, directory: HostDirectory, gateway: Gateway, control_address: str) -> None:
        self.directory = directory
        self.gateway = gateway
        self.control_address = control_address
        #: The Kernel Gateway API, when ``http_address`` is set.
        self.http: HttpApi | None = None

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
                    policy=settings.cluster.placement_policy,
                    replicas_per_kernel=settings.cluster.replicas_per_kernel,
                    heartbeat_interval=conf.heartbeat_s,
                    missed_heartbeats=conf.missed_heartbeats,
                )
            )
            tg = await stack.enter_async_context(anyio.create_task_group())
            backend = await AgentBackend.open(directory, tg)
            stack.callback(tg.cancel_scope.cancel)
            if conf.local_agents:
                await _local_agents(settings, transport.address, run_dir, stack)
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
            service = cls(directory, gateway, control)
            tg.start_soon(serve_control, socket, service.handle)
            log.info("gateway: control at %s, agents at %s", control, transport.address)
            if conf.http_address:
                service.http = await stack.enter_async_context(
                    serve_http(conf, gateway, service.max_host_gpus)
                )
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

    def max_host_gpus(self) -> int:
        """The GPU count of the largest host that is up (the kernelspecs offered)."""
        return max((len(h.gpus) for h in self.directory.hosts() if not h.vanished), default=0)

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


async def _local_agents(
    settings: Settings, gateway: str, run_dir: Path, stack: AsyncExitStack
) -> None:
    """``[cluster] hosts`` agents on this machine, stopped (with their replicas) at the end."""
    for i in range(1, settings.cluster.hosts + 1):
        host = f"host-{i}"
        argv = [sys.executable, "-m", "nbos", "--log-level", "INFO", "agent", "--host", host]
        argv += ["--address", "127.0.0.1:0", "--gateway", gateway.removeprefix("tcp://")]
        argv += ["--state-dir", str(run_dir / "agents" / host)]
        argv += ["--gpus", str(settings.cluster.gpus_per_host), "--stop-replicas-on-exit"]
        argv += ["--heartbeat", str(settings.gateway.heartbeat_s)]
        if settings.gateway.keys:
            argv += ["--keys", settings.gateway.keys]
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        with (run_dir / "agents" / f"{host}.log").open("ab") as out:
            process = await anyio.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        stack.push_async_callback(_stop_agent, process)


async def _stop_agent(process: anyio.abc.Process) -> None:
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(_AGENT_STOP_S) as scope:
            await process.wait()
        if scope.cancelled_caught:
            log.warning("local agent pid %d ignored SIGTERM: SIGKILL", process.pid)
            process.kill()
            await process.wait()


async def run_until_signalled(settings: Settings) -> None:
    """Serve ``settings`` in the foreground until SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with GatewayService.serve(settings):
            async for signum in signals:
                log.info("gateway: %s, stopping", signal.strsignal(signum))
                return
