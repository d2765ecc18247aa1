"""Subscription-ratio admission: which hosts may take one more replica of a kernel.

A replica subscribes its kernel's GPU count on its host whether or not a cell
runs, so a host's *subscription ratio* is

    SR(host) = gpus_subscribed / gpus_total / replicas_per_kernel

(dividing by the replication factor because at most one of a kernel's replicas
executes at a time). A host is admitted for a new replica while its ratio after
placing it does not exceed the cluster's moving demand-to-busy ratio
(``ClusterView.demand_to_busy_ratio``): the more of the subscribed GPUs sit idle
cluster-wide, the more a host may be oversubscribed.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence

from nbos.core.errors import PlacementError
from nbos.core.placement import ClusterView, HostView, PlacementRequest

log = logging.getLogger(__name__)

#: Slack for float error, so that a ratio landing exactly on the limit is admitted.
_EPSILON = 1e-9


def subscription_ratio(host: HostView, replicas_per_kernel: int, extra_gpus: int = 0) -> float:
    """The host's subscription ratio with ``extra_gpus`` more subscribed."""
    subscribed = host.gpus_subscribed + extra_gpus
    if host.gpus_total <= 0:
        return 0.0 if subscribed <= 0 else math.inf
    return subscribed / host.gpus_total / replicas_per_kernel


def ratio_after(host: HostView, request: PlacementRequest, cluster: ClusterView) -> float:
    """The host's subscription ratio once one replica of ``request`` is placed on it."""
    return subscription_ratio(host, cluster.replicas_per_kernel, request.gpus)


def admissible(request: PlacementRequest, cluster: ClusterView) -> list[HostView]:
    """Hosts that may take a replica of ``request``, sorted by host id.

    Raises :class:`PlacementError` for a malformed request or cluster view.
    Rejected hosts are not an error here; :func:`require` turns too few into one.
    """
    check_request(request, cluster)
    return sorted(
        (h for h in cluster.hosts if admits(h, request, cluster)),
        key=lambda h: h.host_id,
    )


def admitted_first(
    groups: Iterable[Iterable[HostView]], request: PlacementRequest, cluster: ClusterView
) -> list[HostView]:
    """The first ``request.replicas`` admitted hosts of each group, for groups that list
    their admitted hosts first (hosts of one size, least subscribed first: the ratio after a
    placement grows along such a group, so admission ends at the first host it rejects)."""
    check_request(request, cluster)

    def admitted(host: HostView) -> bool:
        return admits(host, request, cluster)

    return [
        h
        for hosts in groups
        for h in itertools.islice(itertools.takewhile(admitted, hosts), request.replicas)
    ]


def admits(host: HostView, request: PlacementRequest, cluster: ClusterView) -> bool:
    """Whether ``host`` may take a replica of ``request``."""
    return _reject_reason(host, request, cluster) is None


def require(
    candidates: Sequence[HostView], request: PlacementRequest, cluster: ClusterView
) -> None:
    """Raise :class:`PlacementError` explaining why when fewer than ``replicas`` hosts remain."""
    if len(candidates) >= request.replicas:
        return
    reasons = Counter(
        reason for h in cluster.hosts if (reason := _reject_reason(h, request, cluster)) is not None
    )
    detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) or "no hosts"
    message = (
        f"cannot place kernel {request.kernel_id}: {request.replicas} replicas with "
        f"{request.gpus} GPUs each need {request.replicas} distinct hosts, "
        f"{len(candidates)} of {len(cluster.hosts)} qualify ({detail})"
    )
    log.info("%s", message)
    raise PlacementError(message)


def _reject_reason(host: HostView, request: PlacementRequest, cluster: ClusterView) -> str | None:
    if host.host_id in request.exclude:
        return "excluded"
    if not host.schedulable:
        return "full" if host.full else "not schedulable"
    if host.gpus_total < request.gpus:
        return f"with fewer than {request.gpus} GPUs"
    if ratio_after(host, request, cluster) > cluster.demand_to_busy_ratio + _EPSILON:
        return f"over the subscription limit {cluster.demand_to_busy_ratio:g}"
    return None


def check_request(request: PlacementRequest, cluster: ClusterView) -> None:
    """:class:`PlacementError` for a malformed request or cluster view."""
    problem = None
    if request.replicas < 1 or request.gpus < 0:
        problem = (
            f"bad placement request for kernel {request.kernel_id}: "
            f"replicas={request.replicas}, gpus={request.gpus}"
        )
    elif cluster.replicas_per_kernel < 1 or not cluster.demand_to_busy_ratio >= 0:
        problem = (
            f"bad cluster view: replicas_per_kernel={cluster.replicas_per_kernel}, "
            f"demand_to_busy_ratio={cluster.demand_to_busy_ratio}"
        )
    elif cluster.has_duplicates():
        ids = sorted(h.host_id for h in cluster.hosts)
        problem = f"bad cluster view: duplicate host ids in {ids}"
    if problem is not None:
        log.warning("%s", problem)
        raise PlacementError(problem)


def migration_candidates(request: PlacementRequest, cluster: ClusterView) -> list[HostView]:
    """Schedulable hosts outside ``exclude`` that can commit the request's GPUs now, by id."""
    check_request(request, cluster)
    return sorted(
        (
            h
            for h in cluster.hosts
            if h.schedulable and h.host_id not in request.exclude and h.gpus_idle >= request.gpus
        ),
        key=lambda h: h.host_id,
    )
