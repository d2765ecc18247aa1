"""One cluster's scheduling decisions, made by one object that the gateway and the simulator share.

:class:`ClusterDecisions` holds the cluster's placement policy (one instance per
cluster) and, optionally, its :class:`~nbos.scaling.Autoscaler`, and answers each
event with a value:

* a kernel starts: :meth:`~ClusterDecisions.place` (hosts for its replicas);
* a replica must be replaced or moved off a draining host: :meth:`~ClusterDecisions.place_one`;
* a cell is ready: :meth:`~ClusterDecisions.cell` (run it on this replica's host,
  migrate this replica there first, or wait);
* a session of the reservation baseline starts: :meth:`~ClusterDecisions.reserve`;
* the autoscaler's period: :meth:`~ClusterDecisions.scale` (scale out, scale in, hold),
  and :meth:`~ClusterDecisions.removable` for when a drained host may go.

Every host a policy answers with is checked in one place,
:func:`~nbos.scaling._validate.validate_hosts`; an answer that breaks the policy
contract raises :class:`~nbos.core.errors.PolicyContractError`, a subclass of
:class:`~nbos.core.errors.PlacementError`, so callers can tell a full cluster
(wait, scale out) from a broken policy (stop).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

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


class ClusterDecisions:
    """The scheduling decisions of one cluster, over :class:`ClusterView` snapshots.

    Build one per cluster (:meth:`load` by policy name) and give it to whatever
    drives the cluster: the gateway's scheduler or the simulator. It keeps no
    state of its own beyond the policy's and the autoscaler's.
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
        return self._place(cluster, request)

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
    ) -> CellDecision:
        """Where a ready cell asking for ``gpus`` runs (``docs/placement.md``).

        :class:`Execute` on a replica's host; else, when another host could commit
        the GPUs, the :class:`MigrationPlan` moving the busiest replica there; else
        :class:`Wait`. Raises :class:`GpuError` for a negative count,
        :class:`InsufficientGpusError` for more GPUs than any host has, and
        :class:`PolicyContractError` for a bad migration target.
        """
        choice = execute_or_wait(last_host, replica_hosts, cluster, gpus)
        if choice is not None:
            return choice
        request = PlacementRequest(kernel_id, gpus, 1)
        plan = plan_migration(replica_hosts, request, cluster, self._policy)
        if plan is None:
            return Wait(f"waiting for {gpus} GPUs: no host outside the replicas' can take one")
        return plan

    # --- scaling -----------------------------------------------------------------

    def scale(
        self, cluster: ClusterView, now: float, placement_failed: bool, provisioning: int
    ) -> ScaleDecision:
        """The autoscaler's decision at ``now`` (:class:`Hold` without an autoscaler)."""
        if self._autoscaler is None:
            return Hold("no autoscaler")
        return self._autoscaler.decide(cluster, now, placement_failed, provisioning)

    @staticmethod
    def removable(host: HostView) -> bool:
        """Whether a draining host may leave: it holds no replica and no committed GPU."""
        return not host.schedulable and host.replicas == 0 and host.gpus_committed == 0
