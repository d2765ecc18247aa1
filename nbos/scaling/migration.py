"""Which replica of a kernel moves, and where, when none of its hosts can commit a cell's GPUs.

A pure decision (design, "Failures, migration, scaling"): the replica on the
busiest of the kernel's hosts moves, because that host is the least likely to
free GPUs soon; the policy's ``migration_target`` picks the destination among
hosts that hold no replica of the kernel. ``None`` means no host can take it
now: the cell waits, which the autoscaler counts as a placement failure.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import attrs

from nbos.core.errors import PlacementError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView, PlacementPolicy, PlacementRequest
from nbos.scaling._validate import validate_hosts

log = logging.getLogger(__name__)


@attrs.frozen
class MigrationPlan:
    """Move the replica of ``kernel_id`` on ``source`` to ``target``, then run the cell there."""

    kernel_id: KernelId
    source: HostId
    target: HostId


def plan_migration(
    replica_hosts: Sequence[HostId],
    request: PlacementRequest,
    cluster: ClusterView,
    policy: PlacementPolicy,
    down: Collection[HostId] = (),
) -> MigrationPlan | None:
    """Plan moving one replica of ``request.kernel_id`` to a host that can commit ``request.gpus``.

    The source is the replica host with the fewest idle GPUs (a host missing from
    ``cluster``, or in ``down``, counts as the busiest: it cannot run anything); ties go to the
    higher subscription, then the earlier host in ``replica_hosts``. The target is
    ``policy.migration_target`` with every replica host (and ``request.exclude``)
    excluded. Returns ``None`` when the policy finds no target. Raises
    :class:`PlacementError` when ``replica_hosts`` is empty or repeats a host, and
    :class:`~nbos.core.errors.PolicyContractError` (a ``PlacementError``) when the
    policy breaks its contract (a target that is excluded, unknown, unschedulable or
    without ``request.gpus`` idle GPUs).
    """
    if not replica_hosts or len(set(replica_hosts)) != len(replica_hosts):
        raise _refused(
            f"kernel {request.kernel_id}: cannot migrate with replica hosts {list(replica_hosts)}"
        )
    source = _busiest(replica_hosts, cluster, down)
    exclude = request.exclude | frozenset(replica_hosts)
    target = policy.migration_target(attrs.evolve(request, exclude=exclude), cluster)
    if target is None:
        log.info(
            "kernel %s: no host outside %s can commit %d GPUs for a migration",
            request.kernel_id,
            sorted(exclude),
            request.gpus,
        )
        return None
    validate_hosts(
        policy.name,
        attrs.evolve(request, replicas=1, exclude=exclude),
        (target,),
        cluster,
        commit_now=True,
    )
    log.debug("kernel %s: migrate replica %s -> %s", request.kernel_id, source, target)
    return MigrationPlan(request.kernel_id, source, target)


def _busiest(
    replica_hosts: Sequence[HostId], cluster: ClusterView, down: Collection[HostId]
) -> HostId:
    def rank(item: tuple[int, HostId]) -> tuple[float, int, int]:
        index, host_id = item
        view: HostView | None = cluster.get(host_id)
        if view is None or host_id in down:
            return (float("-inf"), 0, index)
        return (view.gpus_idle, -view.gpus_subscribed, index)

    return min(enumerate(replica_hosts), key=rank)[1]


def _refused(message: str) -> PlacementError:
    log.warning("%s", message)
    return PlacementError(message)
