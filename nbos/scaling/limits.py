"""What one host takes: the per-host limits of placement, the gateway's and the simulator's.

A host at its limit is full: :class:`~nbos.scaling.ClusterModel` shows it unschedulable,
so that no policy places a replica there, nor moves one there, while its own replicas go
on running cells. A kernel that finds fewer free hosts than it has replicas is not
placed (the gateway refuses its start as overloaded).
"""

from __future__ import annotations

import attrs

from nbos.core.config import ClusterSettings
from nbos.core.errors import ConfigError


@attrs.frozen
class HostLimits:
    """At most ``max_replicas`` replicas on a host (``None``: no limit), and no new one
    while its free memory is under ``min_free_memory_mib`` (0: no floor; a host whose
    free memory is unknown, a simulated one or an agent that does not say, is not
    refused for it)."""

    max_replicas: int | None = None
    min_free_memory_mib: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_replicas is not None and not _count(self.max_replicas, least=1):
            raise ConfigError("max_replicas", self.max_replicas, "at least 1, or None")
        if not _count(self.min_free_memory_mib, least=0):
            raise ConfigError("min_free_memory_mib", self.min_free_memory_mib, "MiB, 0 or more")

    @classmethod
    def of(cls, settings: ClusterSettings) -> HostLimits:
        """The limits ``[cluster]`` sets (``max_replicas_per_host = 0``: none)."""
        try:
            return cls(settings.max_replicas_per_host or None, settings.min_free_memory_mib)
        except ConfigError as exc:
            key = "max_replicas_per_host" if exc.key == "max_replicas" else exc.key
            raise ConfigError(f"cluster.{key}", exc.value, exc.expected) from exc

    def full(self, replicas: int, free_memory_mib: int | None) -> bool:
        """Whether a host with ``replicas`` and that much free memory takes no new replica."""
        if self.max_replicas is not None and replicas >= self.max_replicas:
            return True
        return free_memory_mib is not None and free_memory_mib < self.min_free_memory_mib


def _count(value: object, *, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
