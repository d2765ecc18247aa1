"""Live autoscaling: the simulator's :class:`~nbos.scaling.Autoscaler`, on the real cluster.

Every ``period`` seconds the gateway asks the cluster's
:class:`~nbos.scaling.ClusterDecisions` (the scheduler's, so the one the simulator
makes) for a scaling decision over the scheduler's view, with the cells waiting
for GPUs (the decisions remember, as placement failures, the kernels they could not
place since the last decision) and the hosts being started counted as provisioning.
Then:

* :class:`~nbos.scaling.ScaleOut`: the host provider starts that many hosts; each
  counts as provisioning until its agent registered and reported its GPUs (or, after
  ``host_timeout`` seconds without that, it is given back and logged);
* :class:`~nbos.scaling.ScaleIn`: each host is drained: made unschedulable (no new
  replicas, and cells go to the kernels' other replicas), then each replica there is
  replaced by one on a host the policy picks (a learner that catches up from the
  snapshot and log, as a replacement does), waiting for a cell it runs to end first.
  The host leaves (the directory forgets it, the provider stops its agent) once
  :meth:`~nbos.scaling.ClusterDecisions.removable` says it holds no replica and no
  committed GPU; moves that fail are retried every period meanwhile.

A drained host stays out of service until it leaves, as in the simulator.

The first decision waits ``settle`` seconds at least (the gateway passes its failure
detector's window): agents that ran before this gateway started, with an earlier run of
it or beside it in a swarm, speak within that window. A decision before it would count
them as missing and scale out below the floor (the simulator starts with its hosts).
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from nbos.core.errors import HostUnreachableError, NbosError
from nbos.core.host_provider import AgentCommand, HostProvider
from nbos.core.ids import HostId, KernelId
from nbos.gateway._directory import HostDirectory
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import KernelManager
from nbos.metrics import ClusterEvent, events
from nbos.scaling import ScaleIn, ScaleOut

log = logging.getLogger(__name__)

#: How long a drain waits for a cell running on a replica it is to move.
_CELL_WAIT_S = 0.1


class LiveAutoscaler:
    """Scales ``directory``'s cluster through ``provider``; run :meth:`run` in a task group."""

    def __init__(
        self,
        directory: HostDirectory,
        kernel_manager: KernelManager,
        provider: HostProvider,
        agent: AgentCommand,
        *,
        period: float,
        host_timeout: float,
        settle: float = 0.0,
        precopy: bool = False,
    ) -> None:
        self._directory = directory
        self._kernel_manager = kernel_manager
        self._provider = provider
        self._agent = agent
        self._period = period
        self._host_timeout = host_timeout
        self._settle = settle
        self._draining: set[HostId] = set()
        self._precopy = precopy
        self._copying: set[KernelId] = set()
        # Each kernel copied ahead, with its last settled cell then: once per idle spell.
        self._copied: dict[KernelId, int] = {}

    @property
    def draining(self) -> frozenset[HostId]:
        """Hosts being drained now."""
        return frozenset(self._draining)

    async def run(self) -> None:
        """Decide every period, forever; actions run as tasks of their own."""
        async with anyio.create_task_group() as tg:
            await anyio.sleep(max(self._period, self._settle))
            while True:
                self.tick(tg)
                await anyio.sleep(self._period)

    def tick(self, tg: anyio.abc.TaskGroup) -> None:
        """One decision, its actions started in ``tg``."""
        scheduler = self._directory.scheduler
        step = scheduler.scale(
            anyio.current_time(), kernels_waiting=bool(self._kernel_manager.starts_waiting)
        )
        decision = step.decision
        if self._precopy:
            self._start_precopies(tg)
        if step.at_ceiling:
            scheduler.ledger.ceiling_s += self._period
        if isinstance(decision, ScaleOut):
            scheduler.ledger.scale_outs += 1
            events().happened(
                ClusterEvent("scale-out", f"autoscaler: adding {decision.count} host(s)")
            )
            scheduler.hosts_asked(decision.count)
            for _ in range(decision.count):
                tg.start_soon(self._add)
        elif isinstance(decision, ScaleIn):
            scheduler.ledger.scale_ins += 1
            for host in decision.hosts:
                if host not in self._draining:
                    self._draining.add(host)
                    events().happened(
                        ClusterEvent("scale-in", f"autoscaler: draining host {host}", host=host)
                    )
                    tg.start_soon(self._drain, host)

    def _start_precopies(self, tg: anyio.abc.TaskGroup) -> None:
        """Copy a replica of each idle kernel whose next cell would have to migrate: the
        move :meth:`~nbos.scaling.ClusterDecisions.precopy` names (the simulator's too)."""
        scheduler = self._directory.scheduler
        waiting = {kernel_id for kernel_id, _ in scheduler.waiting()}
        kernels = self._kernel_manager.kernels
        self._copied = {
            k.kernel_id: self._copied[k.kernel_id] for k in kernels if k.kernel_id in self._copied
        }
        for kernel in kernels:
            kernel_id = kernel.kernel_id
            replicas = kernel.replicas
            idle = kernel.front.running_on is None and kernel_id not in waiting
            steady = kernel.joining is None and all(r.alive for r in replicas)
            again = self._copied.get(kernel_id) == kernel.front.settled_exec_index
            if not (idle and steady) or again or kernel_id in self._copying:
                continue
            hosts = scheduler.model.replica_hosts(kernel_id)
            staying = scheduler.decisions.off_draining(hosts, scheduler.model.is_draining)
            gpus = scheduler.model.placed_gpus(kernel_id)
            plan = scheduler.decisions.precopy(scheduler.view(), kernel_id, staying, gpus)
            source = next((r.node for r in replicas if plan and r.host == plan.source), None)
            if plan is not None and source is not None:
                self._copying.add(kernel_id)
                self._copied[kernel_id] = kernel.front.settled_exec_index
                tg.start_soon(self._copy, kernel, source, plan.target)

    async def _copy(self, kernel: Kernel, node: int, target: HostId) -> None:
        kernel_id = kernel.kernel_id
        log.info("autoscaler: pre-copying kernel %s replica %d to %s", kernel_id, node, target)
        try:
            await kernel.replace_replica(node, target=target)
        except NbosError as exc:
            log.warning("autoscaler: pre-copy of kernel %s failed: %s", kernel_id, exc)
        else:
            self._directory.scheduler.ledger.migrations += 1
        finally:
            self._copying.discard(kernel_id)

    async def _add(self) -> None:
        scheduler = self._directory.scheduler
        try:
            await self.start_host()
        except NbosError as exc:
            log.warning("autoscaler: %s could not add a host: %s", self._provider.name, exc)
        finally:
            scheduler.hosts_arrived(1)

    async def start_host(self) -> HostId:
        """Have the provider start a host; return once its agent registered and reported.

        Raises :class:`NbosError` when the provider could not start one, and
        :class:`HostUnreachableError` when it did not register within ``host_timeout``
        (it is given back, logged).
        """
        host = await self._provider.add_host(self._agent)
        try:
            await self._directory.scheduler.wait_for_host(host, self._host_timeout)
        except TimeoutError:
            log.warning(
                "autoscaler: host %s did not register within %g s: given back",
                host,
                self._host_timeout,
            )
            await self._remove(host)
            raise HostUnreachableError(
                host, f"it did not register within {self._host_timeout:g} s"
            ) from None
        log.info("autoscaler: host %s joined", host)
        return host

    async def stop_host(self, host: HostId) -> None:
        """Forget ``host`` and have the provider stop it (errors logged)."""
        await self._remove(host)

    async def _drain(self, host: HostId) -> None:
        started = anyio.current_time()
        log.info("autoscaler: draining host %s", host)
        try:
            await empty_host(self._directory, self._kernel_manager, host, self._period)
        except KeyError:
            log.info("autoscaler: host %s went away while draining", host)
        else:
            log.info("autoscaler: host %s drained in %.1f s", host, anyio.current_time() - started)
        finally:
            self._draining.discard(host)
        await self._remove(host)

    async def _remove(self, host: HostId) -> None:
        self._directory.remove(host)
        try:
            await self._provider.remove_host(host)
        except NbosError as exc:
            log.warning("autoscaler: %s could not stop host %s: %s", self._provider.name, host, exc)


async def empty_host(
    directory: HostDirectory, kernel_manager: KernelManager, host: HostId, period: float
) -> None:
    """Drain ``host``: make it unschedulable (no new replicas; cells go to the kernels'
    other replicas), then move each replica there to a host the policy picks, retrying
    every ``period`` until the decisions find it removable (no replica, no committed GPU).
    Raises ``KeyError`` when the host leaves the scheduler meanwhile. The autoscaler's
    scale-in and a swarm node's drain (:mod:`nbos.gateway._leave`) both drain so."""
    scheduler = directory.scheduler
    scheduler.set_schedulable(host, False)
    while True:
        for kernel in kernel_manager.kernels:
            await _move_off(directory, kernel, host)
        if scheduler.decisions.removable(scheduler.view().host(host)):
            return
        await anyio.sleep(period)


async def _move_off(directory: HostDirectory, kernel: Kernel, host: HostId) -> None:
    for replica in kernel.replicas:
        if replica.host != host:
            continue
        # A cell running there would be lost with the replica: let it end. New cells
        # go to the kernel's other replicas (the scheduler avoids draining hosts).
        await _cell_over(kernel, replica.node)
        try:
            node = await kernel.replace_replica(replica.node)
        except NbosError as exc:
            log.warning(
                "drain: replica %d of kernel %s not moved off %s (retried): %s",
                replica.node,
                kernel.kernel_id,
                host,
                exc,
            )
            continue
        directory.scheduler.ledger.drain_moves += 1
        log.info(
            "drain: kernel %s replica %d moved off %s as %d",
            kernel.kernel_id,
            replica.node,
            host,
            node,
        )


async def _cell_over(kernel: Kernel, node: int) -> None:
    """Return once replica ``node`` runs no shell request (the front has no event for it)."""
    while True:
        if kernel.front.running_on != node or kernel.closed.is_set():
            return
        await anyio.sleep(_CELL_WAIT_S)
