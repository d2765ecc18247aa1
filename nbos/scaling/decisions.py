"""One cluster's scheduling decisions, made by one object that the gateway and the simulator share.

:class:`ClusterDecisions` holds the cluster's placement policy (one instance per
cluster) and, optionally, its :class:`~nbos.scaling.Autoscaler`, and answers each
event with a value:

* a kernel starts: :meth:`~ClusterDecisions.place` (hosts for its replicas);
* a replica must be replaced or moved off a draining host: :meth:`~ClusterDecisions.place_one`;
* a cell is ready: :meth:`~ClusterDecisions.cell` (run it on this replica's host,
  migrate this replica there first, or wait);
* a session of the reservation baseline starts: :meth:`~ClusterDecisions.reserve`;
* the autoscaler's period: :meth:`~ClusterDecisions.scale` (scale out, scale in, hold,
  and whether work waits at the host ceiling), and :meth:`~ClusterDecisions.removable`
  for when a drained host may go.

The rules around those decisions live here too, so that both sides apply them alike:
which replicas a cell may run on while hosts drain (:meth:`~ClusterDecisions.off_draining`),
when placement counts as failed for the autoscaler, and when work waits at its ceiling.

Every host a policy answers with is checked in one place,
:func:`~nbos.scaling._validate.validate_hosts`; an answer that breaks the policy
contract raises :class:`~nbos.core.errors.PolicyContractError`, a subclass of
:class:`~nbos.core.errors.PlacementError`, so callers can tell a full cluster
(wait, scale out) from a broken policy (stop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import attrs

from nbos.core.errors import GpuError, PlacementError, PolicyContractError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView, PlacementPolicy, PlacementRequest
from nbos.scaling._validate import validate_hosts
from nbos.scaling.autoscaler import Autoscaler, Hold, ScaleDecision
from nbos.scaling.executor import Execute, Wait, execute_or_wait
from nbos.scaling.migration import MigrationPlan, plan_migration
from nbos.scaling.registry import load_policy

log = logging.getLogger(__name__)

#: What a ready cell does: run on a replica's host, move a replica first, or wait.
CellDecision = Execute | MigrationPlan | Wait


@attrs.frozen
class ScaleStep:
    """The autoscaler's decision for one period, and whether work waited at the ceiling
    (the hosts, with those provisioning, at ``max_hosts``) during it."""

    decision: ScaleDecision
    at_ceiling: bool


class ClusterDecisions:
    """The scheduling decisions of one cluster, over :class:`ClusterView` snapshots.

    Build one per cluster (:meth:`load` by policy name) and give it to whatever
    drives the cluster: the gateway's scheduler or the simulator. Beyond the
    policy's and the autoscaler's state it remembers only whether a kernel could not
    be placed since the last :meth:`scale`.
    """

    def __init__(
        self,
        policy: PlacementPolicy,
        replicas_per_kernel: int = 3,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        self._policy = policy
        self._replicas = replicas_per_kernel
        self._autoscaler = autoscaler
        self._placement_failed = False

    @classmethod
    def load(
        cls,
        policy: PlacementPolicy | str,
        replicas_per_kernel: int = 3,
        autoscaler: Autoscaler | None = None,
        **policy_kwargs: Any,
    ) -> ClusterDecisions:
        """Decisions with ``policy``, or with the policy registered by that name."""
        chosen = load_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
        return cls(chosen, replicas_per_kernel, autoscaler)

    @property
    def policy(self) -> PlacementPolicy:
        return self._policy

    @property
    def replicas_per_kernel(self) -> int:
        return self._replicas

    @property
    def autoscaler(self) -> Autoscaler | None:
        return self._autoscaler

    # --- placement ---------------------------------------------------------------

    def place(
        self,
        cluster: ClusterView,
        kernel_id: KernelId,
        gpus: int,
        exclude: Iterable[HostId] = (),
    ) -> tuple[HostId, ...]:
        """Distinct hosts for the kernel's ``replicas_per_kernel`` replicas.

        Raises :class:`PlacementError` when the policy cannot place it now and
        :class:`PolicyContractError` when it answers with hosts it may not choose.
        """
        request = PlacementRequest(kernel_id, gpus, self._replicas, frozenset(exclude))
        try:
            return self._place(cluster, request)
        except PolicyContractError:
            raise
        except PlacementError:
            self._placement_failed = True
            raise

    def place_one(
        self, cluster: ClusterView, kernel_id: KernelId, gpus: int, exclude: Iterable[HostId]
    ) -> HostId:
        """One host for a replica that must move (replaced, or off a draining host); ``exclude``
        holds the kernel's other hosts. Errors as :meth:`place`."""
        (host,) = self._place(cluster, PlacementRequest(kernel_id, gpus, 1, frozenset(exclude)))
        return host

    def _place(self, cluster: ClusterView, request: PlacementRequest) -> tuple[HostId, ...]:
        chosen = self._policy.place(request, cluster)
        return validate_hosts(self._policy.name, request, chosen, cluster)

    def reserve(self, cluster: ClusterView, kernel_id: KernelId, gpus: int) -> HostId | None:
        """The reservation baseline: a host that can commit ``gpus`` now for a session's life
        (the policy's ``migration_target``), or ``None``. :class:`PolicyContractError` as above."""
        request = PlacementRequest(kernel_id, gpus, 1)
        target = self._policy.migration_target(request, cluster)
        if target is None:
            return None
        validate_hosts(self._policy.name, request, (target,), cluster, commit_now=True)
        return target

    # --- cells -------------------------------------------------------------------

    def cell(
        self,
        cluster: ClusterView,
        kernel_id: KernelId,
        replica_hosts: Sequence[HostId],
        last_host: HostId | None,
        gpus: int,
        *,
        down: Collection[HostId] = (),
    ) -> CellDecision:
        """Where a ready cell asking for ``gpus`` runs (``docs/placement.md``).

        :class:`Execute` on a replica's host; else, when another host could commit
        the GPUs, the :class:`MigrationPlan` moving the busiest replica there; else
        :class:`Wait`. Replica hosts in ``down`` (their agents do not answer, or they
        refused the cell) run nothing and are the first to lose their replica.
        Raises :class:`GpuError` for a negative count,
        :class:`InsufficientGpusError` for more GPUs than any host has, and
        :class:`PolicyContractError` for a bad migration target.
        """
        choice = execute_or_wait(last_host, replica_hosts, cluster, gpus, down)
        if choice is not None:
            return choice
        request = PlacementRequest(kernel_id, gpus, 1)
        plan = plan_migration(replica_hosts, request, cluster, self._policy, down)
        if plan is None:
            return Wait(f"waiting for {gpus} GPUs: no host outside the replicas' can take one")
        return plan

    def precopy(
        self,
        cluster: ClusterView,
        kernel_id: KernelId,
        replica_hosts: Sequence[HostId],
        gpus: int,
    ) -> MigrationPlan | None:
        """The replica to copy now, ahead of the idle kernel's next cell (``docs/placement.md``,
        "Pre-copy"), or ``None``.

        When none of the replicas' hosts could commit the kernel's ``gpus`` now, its next
        cell would wait for a migration: the move that cell would get from :meth:`cell` is
        made now instead, while no cell waits for it. ``None`` when a replica's host has
        the GPUs idle, no other host has, or the kernel asks for none.
        """
        if gpus <= 0 or not replica_hosts:
            return None
        try:
            choice = self.cell(cluster, kernel_id, replica_hosts, None, gpus)
        except PolicyContractError:
            raise
        except (GpuError, PlacementError):
            return None  # more GPUs than any host has: its cells wait whatever is copied
        return choice if isinstance(choice, MigrationPlan) else None

    @staticmethod
    def off_draining(
        replica_hosts: Sequence[HostId], draining: Callable[[HostId], bool]
    ) -> Sequence[HostId]:
        """The replica hosts a cell may run on: those not being drained, if the kernel has
        any (a draining host's replica is about to move, and a cell there would be lost
        with it)."""
        staying = [h for h in replica_hosts if not draining(h)]
        return staying or replica_hosts

    # --- scaling -----------------------------------------------------------------

    def scale(
        self,
        cluster: ClusterView,
        now: float,
        *,
        cells_waiting: bool,
        kernels_waiting: bool,
        provisioning: int,
    ) -> ScaleStep:
        """The autoscaler's decision at ``now`` (:class:`Hold` without an autoscaler).

        Placement counts as failed while cells wait for GPUs or kernels for hosts, or
        when a kernel could not be placed since the last call (the live cluster refuses
        it at once, the client asks again). ``provisioning`` hosts are being started.
        """
        failed = cells_waiting or kernels_waiting or self._placement_failed
        self._placement_failed = False
        if self._autoscaler is None:
            return ScaleStep(Hold("no autoscaler"), at_ceiling=False)
        decision = self._autoscaler.decide(cluster, now, failed, provisioning)
        ceiling = self._autoscaler.config.max_hosts
        return ScaleStep(decision, failed and len(cluster.hosts) + provisioning >= ceiling)

    def may_grow(self, cluster: ClusterView, gpus: int, provisioning: int) -> bool:
        """Whether a kernel asking ``gpus`` per cell that cannot be placed now waits for a
        host rather than being refused: the autoscaler may still add one (hosts are on
        their way, or the cluster is below ``max_hosts``) and a new host could take its
        replica. The simulator keeps every such start waiting; the gateway refuses the
        others (the ceiling is a real limit, and its client asks again)."""
        if self._autoscaler is None:
            return False
        config = self._autoscaler.config
        if gpus > config.new_host_gpus:
            return False
        return provisioning > 0 or len(cluster.hosts) < config.max_hosts

    @staticmethod
    def removable(host: HostView) -> bool:
        """Whether a draining host may leave: it holds no replica and no committed GPU."""
        return not host.schedulable and host.replicas == 0 and host.gpus_committed == 0
