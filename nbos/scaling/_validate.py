"""Whether a policy's answer is one it may give: the one check of every placement and target."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from nbos.core.errors import PolicyContractError
from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView, PlacementRequest

log = logging.getLogger(__name__)


def validate_hosts(
    policy: str,
    request: PlacementRequest,
    chosen: Sequence[HostId],
    cluster: ClusterView,
    *,
    commit_now: bool = False,
) -> tuple[HostId, ...]:
    """``chosen`` as a tuple if it validly answers ``request``, else :class:`PolicyContractError`.

    Valid: exactly ``request.replicas`` distinct hosts of ``cluster``, each
    schedulable and outside ``request.exclude``; with ``commit_now``, each with at
    least ``request.gpus`` idle GPUs (a migration or reservation target).
    """
    hosts = tuple(chosen)
    problem = None
    if len(hosts) != request.replicas or len(set(hosts)) != len(hosts):
        problem = f"needs {request.replicas} distinct hosts"
    else:
        problem = next(
            (
                f"{h} is {why}"
                for h in hosts
                if (why := _unfit(h, cluster.get(h), request, commit_now)) is not None
            ),
            None,
        )
    if problem is not None:
        message = (
            f"policy {policy!r} chose {list(hosts)} for kernel {request.kernel_id} "
            f"({request.gpus} GPUs): {problem}"
        )
        log.warning("%s", message)
        raise PolicyContractError(message)
    return hosts


def _unfit(
    host: HostId, view: HostView | None, request: PlacementRequest, commit_now: bool
) -> str | None:
    if host in request.exclude:
        return "excluded"
    if view is None:
        return "not in the cluster"
    if not view.schedulable:
        return "not schedulable"
    if commit_now and view.gpus_idle < request.gpus:
        return f"left with {view.gpus_idle} idle GPUs"
    return None
