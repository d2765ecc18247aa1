"""The ``PlacementPolicy`` interface and the read-only views policies decide on.

Policies are pure: they see snapshots of the cluster as plain frozen values and
return decisions, so the real gateway and the trace-driven simulator run the
same policy objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from nbos.core.ids import HostId, KernelId


@attrs.frozen
class HostView:
    """One host as a policy sees it.

    ``gpus_subscribed`` counts GPUs *placed* on the host: each replica placed there
    subscribes the GPU count of its kernel, whether or not a cell runs. It may exceed
    ``gpus_total`` (oversubscription). ``gpus_committed`` counts GPUs bound to
    running cells or pre-committed for them; ``gpus_idle = gpus_total - committed``.
    """

    host_id: HostId
    gpus_total: int
    gpus_committed: int
    gpus_subscribed: int
    replicas: int
    schedulable: bool = True

    @property
    def gpus_idle(self) -> int:
        return self.gpus_total - self.gpus_committed


@attrs.frozen
class ClusterView:
    """The whole cluster as a policy sees it, plus the demand figures admission uses."""

    hosts: Sequence[HostView]
    replicas_per_kernel: int = 3
    #: Moving ratio of GPUs demanded (subscribed) to GPUs busy, cluster-wide.
    demand_to_busy_ratio: float = 1.0

    def host(self, host_id: HostId) -> HostView:
        for h in self.hosts:
            if h.host_id == host_id:
                return h
        raise KeyError(host_id)


@attrs.frozen
class PlacementRequest:
    """A kernel to place: its id, GPUs per cell, and hosts it must avoid."""

    kernel_id: KernelId
    gpus: int
    replicas: int = 3
    exclude: frozenset[HostId] = frozenset()


@runtime_checkable
class PlacementPolicy(Protocol):
    """Chooses hosts for replicas. Registered under entry point group ``nbos.placement_policies``.

    * ``place`` returns ``request.replicas`` distinct host ids not in
      ``request.exclude``, or raises :class:`~nbos.core.errors.PlacementError`
      (the autoscaler reads that as a signal to add hosts).
    * ``migration_target`` returns a host that can commit ``request.gpus`` now,
      for moving one replica there, or ``None`` if no host can.
    * Policies must not mutate the views and should be deterministic given their
      inputs (and their own seeded randomness), so the simulator can replay them.
    """

    @property
    def name(self) -> str:
        """The name the policy is registered under."""
        ...

    def place(self, request: PlacementRequest, cluster: ClusterView) -> Sequence[HostId]:
        """Hosts for the kernel's replicas."""
        ...

    def migration_target(self, request: PlacementRequest, cluster: ClusterView) -> HostId | None:
        """A host to move one replica to, or ``None``."""
        ...
