"""GPUs of the embedded cluster: one host agent per virtual host and one GPU scheduler.

Every virtual host of a :class:`~nbos.cluster.LocalCluster` gets a
:class:`~nbos.agent.HostAgent` owning a :class:`~nbos.gpu.GpuPool`, and the
cluster runs one :class:`~nbos.gateway.GpuScheduler`. They talk through real
:class:`~nbos.core.transport.Transport` endpoints of an in-process
:class:`~nbos.transport.MemoryNetwork` (no loss, no delay): the messages, retries
and idempotence are those of a multi-machine deployment, only the wire is memory.

The GPUs are found once with :func:`~nbos.gpu.discover_gpus`: NVML devices where
a driver exists, else ``[cluster] gpus_per_host`` virtual ones. The virtual hosts
all run on this machine, so with real GPUs each of them accounts for the same
physical devices; the embedded cluster is for one user and for tests.

Lazy eviction reaches the replicas through the kernel fronts: when an agent hands
out a device that holds another kernel's tensors, its ``on_evict`` hook sends that
kernel's replica on the host an ``nbos_evict_request`` on the control channel, and
the replica answers once it moved its tensors off.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import attrs

from nbos.agent import EVICT_TIMEOUT_S, EvictHook, HostAgent
from nbos.core.config import ClusterSettings
from nbos.core.errors import GpuError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import PlacementPolicy
from nbos.gateway._scheduler import GpuScheduler
from nbos.gpu import GpuPool, Inventory, discover_gpus
from nbos.gpu.inventory import DiscoveryMode
from nbos.kernel.front import KernelFront
from nbos.scaling import FairShare, HostLimits
from nbos.transport import MemoryNetwork

log = logging.getLogger(__name__)

GATEWAY_PEER = "gateway"
#: How long a pre-commit waits for its cell before the agent frees it.
PRECOMMIT_TTL_S = 30.0
_HOSTS_TIMEOUT_S = 10.0
#: How long freeing a gone kernel's GPUs may hold up its caller; an agent that did not
#: answer by then is told when it reports again (the scheduler owes it the release).
_CLEANUP_TIMEOUT_S = 5.0


@attrs.frozen
class Eviction:
    """One lazy eviction the agent of ``host`` had done: ``kernel``'s tensors left ``devices``."""

    host: HostId
    kernel_id: KernelId
    devices: tuple[int, ...]


@attrs.define
class _KernelRoute:
    front: KernelFront
    #: Node id -> host; shared with the kernel's chooser, which follows replacements.
    hosts: Mapping[int, HostId]

    def node_on(self, host: HostId) -> int | None:
        return next((n for n, h in self.hosts.items() if h == host), None)


class ClusterGpus:
    """The host agents and the GPU scheduler of one embedded cluster; build with :meth:`serve`."""

    def __init__(self, inventory: Inventory | None, scheduler: GpuScheduler) -> None:
        # ``inventory``: the in-process agents' GPUs; None where agents are remote
        # (``nbos gateway``), which report their own.
        self.inventory = inventory
        self.scheduler = scheduler
        self.agents: dict[HostId, HostAgent] = {}
        self.evictions: list[Eviction] = []
        self._routes: dict[KernelId, _KernelRoute] = {}

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        hosts: Sequence[HostId],
        settings: ClusterSettings,
        *,
        policy: PlacementPolicy | str | None = None,
        discovery: DiscoveryMode = "auto",
        fair_share: FairShare | None = None,
    ) -> AsyncIterator[ClusterGpus]:
        """Agents for ``hosts`` and a scheduler that has heard from all of them.

        ``policy`` defaults to ``settings.placement_policy``, loaded by name from the
        ``nbos.placement_policies`` entry points. ``fair_share``: the users' GPU quotas
        the scheduler keeps to (``None``: none).
        """
        inventory = discover_gpus(settings.gpus_per_host, settings.gpu_memory_mib, mode=discovery)
        log.info("cluster GPUs: %d per host (%s)", len(inventory.devices), inventory.source)
        network = MemoryNetwork()
        gateway = network.endpoint(GATEWAY_PEER)
        chosen = policy if policy is not None else settings.placement_policy
        try:
            async with (
                GpuScheduler.serve(
                    gateway,
                    chosen,
                    # An agent answers a grant only after the eviction it needs (up to
                    # EVICT_TIMEOUT_S); in-process agents do not fall silent, so waiting that
                    # long never hides a dead one.
                    rpc_timeout=EVICT_TIMEOUT_S + 5.0,
                    replicas_per_kernel=settings.replicas_per_kernel,
                    limits=HostLimits.of(settings),
                    fair_share=fair_share,
                ) as scheduler,
                anyio.create_task_group() as tg,
            ):
                gpus = cls(inventory, scheduler)
                for host in hosts:
                    gpus.agents[host] = await tg.start(gpus._run_agent, network, host)
                await scheduler.wait_for_hosts(len(hosts), timeout=_HOSTS_TIMEOUT_S)
                yield gpus
                tg.cancel_scope.cancel()
        finally:
            await gateway.aclose()

    async def _run_agent(
        self,
        network: MemoryNetwork,
        host: HostId,
        *,
        task_status: anyio.abc.TaskStatus[HostAgent],
    ) -> None:
        endpoint = network.endpoint(f"{host}/agent")
        assert self.inventory is not None  # serve() found it
        pool = GpuPool(self.inventory.indices, anyio.current_time, PRECOMMIT_TTL_S)
        try:
            async with HostAgent.serve(
                host,
                endpoint,
                pool,
                gateway=GATEWAY_PEER,
                gateway_address=f"mem://{GATEWAY_PEER}",
                clock=anyio.current_time,
                on_evict=self._evict_hook(host),
                evict_timeout=EVICT_TIMEOUT_S,
            ) as agent:
                task_status.started(agent)
                await anyio.sleep_forever()
        finally:
            await endpoint.aclose()

    # --- kernels ---------------------------------------------------------------------

    def add_kernel(
        self, kernel_id: KernelId, front: KernelFront, hosts: Mapping[int, HostId]
    ) -> None:
        """Route evictions of ``kernel_id`` to its replica on each host.

        ``hosts`` (node -> host) is read at each eviction, so a mapping that follows
        replica replacements keeps the routes right.
        """
        self._routes[kernel_id] = _KernelRoute(front, hosts)

    async def replica_gone(self, kernel_id: KernelId, host: HostId) -> None:
        """The kernel's replica on ``host`` died: what it held there is free again."""
        with _cleanup_scope():
            await self.scheduler.replica_gone(kernel_id, host)

    async def kernel_gone(self, kernel_id: KernelId) -> None:
        """The kernel ended: free its GPUs, residency and placement on every host."""
        self._routes.pop(kernel_id, None)
        with _cleanup_scope():
            await self.scheduler.kernel_gone(kernel_id)

    def idle(self) -> bool:
        """Whether no device of any host is pre-committed, committed or holds resident tensors."""
        return not self.scheduler.grants() and all(
            not a.pool.reservations() and not a.pool.resident() for a in self.agents.values()
        )

    def _evict_hook(self, host: HostId) -> EvictHook:
        async def evict(kernel_id: KernelId, devices: tuple[int, ...]) -> None:
            route = self._routes.get(kernel_id)
            node = route.node_on(host) if route is not None else None
            if route is None or node is None or node not in route.front.alive:
                # No live replica there: its tensors died with it.
                log.info("host %s: kernel %s has no live replica to evict", host, kernel_id)
                return
            reply = await route.front.control_request(
                node, "nbos_evict_request", {"devices": list(devices)}, timeout=EVICT_TIMEOUT_S
            )
            if reply is None or reply["content"].get("status") != "ok":
                why = "no answer" if reply is None else reply["content"].get("evalue", "refused")
                log.warning(
                    "host %s: replica %d of %s did not evict: %s", host, node, kernel_id, why
                )
                raise GpuError(f"replica {node} of kernel {kernel_id} did not evict: {why}")
            self.evictions.append(Eviction(host, kernel_id, devices))

        return evict


def _cleanup_scope() -> anyio.CancelScope:
    # Shielded: a kernel torn down by cancellation still frees its GPUs; bounded: that
    # teardown must not wait on agents that may be gone with it.
    return anyio.CancelScope(shield=True, deadline=anyio.current_time() + _CLEANUP_TIMEOUT_S)
