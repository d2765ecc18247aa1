"""Which replica executes a cell: a pure decision over the gateway's view of the cluster.

The order (design, "One cell, end to end", step 2): the last executor if its host
can commit the kernel's GPUs now (its tensors may still be resident there), else
the replica whose host has the most idle GPUs among those with GPUs committed (to
running cells, pre-commits or moves), else the replica whose host has every GPU
idle, else a migration to a host that can commit them (which
:class:`~nbos.scaling.ClusterDecisions` plans), else the cell waits. Waiting and
migrating are ordinary outcomes, returned as values; only a request no host could
ever satisfy is an error.

A host with every GPU idle is woken last because, left idle, it is where a cell that
no busy host can take moves at once (a spare host) and what the autoscaler drains;
woken for a cell that fits elsewhere, it spreads a few cells over many hosts. In the
simulator this provisioned fewer GPU-hours, mostly at the same or a higher share of
cells started within a second (docs/simulator.md, "Idle hosts woken last, and a cell
runs where it was decided", has the figures and the exceptions).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Literal

import attrs

from nbos.core.errors import GpuError, InsufficientGpusError
from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView
from nbos.scaling._index import current_index

log = logging.getLogger(__name__)


@attrs.frozen
class Execute:
    """Run the cell on the replica at ``host``."""

    host: HostId
    reason: Literal["last-executor", "most-idle"]


@attrs.frozen
class Wait:
    """No host can commit the GPUs now; the cell waits (``reason`` is shown to the client)."""

    reason: str


def execute_or_wait(
    last_executor_host: HostId | None,
    replica_hosts: Sequence[HostId],
    cluster_view: ClusterView,
    gpus: int,
    down: Collection[HostId] = (),
) -> Execute | Wait | None:
    """Where a cell asking for ``gpus`` GPUs runs, if on a replica's host; ``None`` when
    only a migration can run it now (:meth:`~nbos.scaling.ClusterDecisions.cell` then asks
    the policy where to).

    Replica hosts missing from ``cluster_view`` (dead, not yet reported) and those in
    ``down`` run nothing. Ties between replica hosts go to the earlier one in ``replica_hosts``.
    ``"most-idle"`` names the choice among the replicas' hosts (in use first).
    A draining (unschedulable) host still runs cells of the replicas it holds;
    only placement and migration avoid it.
    Raises :class:`GpuError` for a negative count and
    :class:`InsufficientGpusError` when no host in the cluster has ``gpus`` GPUs.
    """
    check_cell_gpus(gpus, cluster_view.largest_gpus())
    replicas = [h for h in _views(replica_hosts, cluster_view) if h.host_id not in down]
    last = next((h for h in replicas if h.host_id == last_executor_host), None)
    if last is not None and last.gpus_idle >= gpus:
        return Execute(last.host_id, "last-executor")
    fitting = [h for h in replicas if h.gpus_idle >= gpus]
    if fitting:
        in_use = [h for h in fitting if h.gpus_committed > 0] or fitting
        # max() keeps the first of equals, so ties go to the earlier replica.
        return Execute(max(in_use, key=lambda h: h.gpus_idle).host_id, "most-idle")
    if not _movable(frozenset(replica_hosts), cluster_view, gpus):
        return Wait(f"waiting for {gpus} GPUs: no host has them idle")
    return None


def _movable(on_replica: frozenset[HostId], cluster: ClusterView, gpus: int) -> bool:
    """Whether a schedulable host without a replica has ``gpus`` idle GPUs."""
    index = current_index(cluster)
    if index is not None:
        return next(index.most_room(gpus, on_replica), None) is not None
    return any(
        h.schedulable and h.host_id not in on_replica and h.gpus_idle >= gpus for h in cluster.hosts
    )


def check_cell_gpus(gpus: int, largest: int) -> None:
    """Refuse a cell's GPU count that no waiting can satisfy, given the ``largest`` host's GPUs.

    :class:`GpuError` for a negative count, :class:`InsufficientGpusError` for more
    than the largest host has. The gateway and the simulator both ask this before
    choosing an executor.
    """
    if gpus < 0:
        log.warning("cell asks for %d GPUs", gpus)
        raise GpuError(f"a cell cannot ask for {gpus} GPUs")
    if gpus > largest:
        log.info("cell asks for %d GPUs; the largest host has %d", gpus, largest)
        raise InsufficientGpusError(gpus, largest, "cluster (no host has that many GPUs)")


def _views(replica_hosts: Sequence[HostId], cluster: ClusterView) -> list[HostView]:
    views = [cluster.get(h) for h in replica_hosts]
    if None in views:
        missing = [h for h, v in zip(replica_hosts, views, strict=True) if v is None]
        log.debug("replica hosts %s are not in the cluster view", missing)
    return [v for v in views if v is not None]
