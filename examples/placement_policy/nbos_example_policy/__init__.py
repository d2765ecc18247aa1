"""``spread-by-name``: an example nbos placement policy.

It places a kernel's replicas on consecutive admitted hosts, starting at a point
given by a hash of the kernel id, so one kernel id always lands on the same hosts
while different kernels spread out. It reuses nbos's subscription-ratio
admission (:func:`nbos.scaling.admissible`) and only decides the order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from nbos.core.errors import PlacementError
from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView, PlacementRequest
from nbos.scaling import admissible


class SpreadByNamePolicy:
    """Hosts chosen by a stable hash of the kernel id."""

    def __init__(self, salt: str = "") -> None:
        self._salt = salt

    @property
    def name(self) -> str:
        return "spread-by-name"

    def place(self, request: PlacementRequest, cluster: ClusterView) -> Sequence[HostId]:
        hosts = self._rotated(admissible(request, cluster), request)
        if len(hosts) < request.replicas:
            raise PlacementError(
                f"spread-by-name: kernel {request.kernel_id} needs {request.replicas} hosts, "
                f"{len(hosts)} are admitted"
            )
        return tuple(h.host_id for h in hosts[: request.replicas])

    def migration_target(self, request: PlacementRequest, cluster: ClusterView) -> HostId | None:
        fits = [
            h
            for h in cluster.hosts
            if h.schedulable and h.host_id not in request.exclude and h.gpus_idle >= request.gpus
        ]
        rotated = self._rotated(sorted(fits, key=lambda h: h.host_id), request)
        return rotated[0].host_id if rotated else None

    def _rotated(self, hosts: list[HostView], request: PlacementRequest) -> list[HostView]:
        if not hosts:
            return hosts
        digest = hashlib.sha256(f"{self._salt}{request.kernel_id}".encode()).digest()
        start = int.from_bytes(digest[:8], "big") % len(hosts)
        return hosts[start:] + hosts[:start]
