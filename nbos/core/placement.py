"""The ``PlacementPolicy`` interface and the read-only views policies decide on.

Policies are pure: they see snapshots of the cluster as plain frozen values and
return decisions, so the real gateway and the trace-driven simulator run the
same policy objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

    ``schedulable``: a new replica may go here. ``full``: it may not only because the
    host is at its limits (``HostLimits``: replicas, free memory); a full host is in
    service still (its replicas run cells on its GPUs), where a drained or suspected one
    is not.
    """

    host_id: HostId
    gpus_total: int
    gpus_committed: int
    gpus_subscribed: int
    replicas: int
    schedulable: bool = True
    full: bool = False

    @property
    def in_service(self) -> bool:
        """Whether the host serves the cluster: schedulable, or only full."""
        return self.schedulable or self.full

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
    #: Host id -> its position in ``hosts``, from a maker that keeps one (the cluster
    #: model), so lookups cost O(1) rather than O(hosts) per view; built on first use
    #: otherwise.
    positions: Mapping[HostId, int] | None = attrs.field(default=None, eq=False, repr=False)
    #: The most GPUs a host has, from a maker that keeps it; computed on first use otherwise.
    largest: int | None = attrs.field(default=None, eq=False, repr=False)

    def host(self, host_id: HostId) -> HostView:
        found = self.get(host_id)
        if found is None:
            raise KeyError(host_id)
        return found

    def get(self, host_id: HostId) -> HostView | None:
        """The host's view, or ``None`` if it is not in this view."""
        i = self._positions().get(host_id)
        return None if i is None else self.hosts[i]

    def has_duplicates(self) -> bool:
        """Whether two hosts share an id (O(1) with the maker's ``positions``)."""
        return len(self._positions()) != len(self.hosts)

    def _positions(self) -> Mapping[HostId, int]:
        positions = self.positions
        if positions is None:
            positions = {h.host_id: i for i, h in enumerate(self.hosts)}
            object.__setattr__(self, "positions", positions)  # a cache: frozen otherwise
        return positions

    def largest_gpus(self) -> int:
        """The most GPUs any host has (0 without hosts)."""
        if self.largest is None:
            largest = max((h.gpus_total for h in self.hosts), default=0)
            object.__setattr__(self, "largest", largest)  # a cache: frozen otherwise
            return largest
        return self.largest


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
