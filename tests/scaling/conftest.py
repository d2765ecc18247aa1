"""Cluster views for the placement tests."""

from __future__ import annotations

from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView, PlacementRequest


def host(
    name: str,
    total: int = 8,
    committed: int = 0,
    subscribed: int = 0,
    schedulable: bool = True,
) -> HostView:
    return HostView(HostId(name), total, committed, subscribed, subscribed, schedulable)


def request(gpus: int = 1, exclude: tuple[str, ...] = (), replicas: int = 3) -> PlacementRequest:
    return PlacementRequest(KernelId("k-1"), gpus, replicas, frozenset(HostId(h) for h in exclude))


def cluster(*hosts: HostView, ratio: float = 1.0, replicas_per_kernel: int = 3) -> ClusterView:
    return ClusterView(hosts, replicas_per_kernel, ratio)
