"""plan_migration: which replica moves (the busiest host's) and where (the policy's target)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from nbos.core.errors import PlacementError, PolicyContractError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView, PlacementRequest
from nbos.scaling import (
    BinPackingPolicy,
    ClusterDecisions,
    LeastLoadedPolicy,
    MigrationPlan,
    plan_migration,
)

from .conftest import cluster

K = KernelId("k-1")


def hv(name: str, committed: int, subscribed: int = 3, schedulable: bool = True) -> HostView:
    return HostView(HostId(name), 8, committed, subscribed, 1, schedulable)


def ids(*names: str) -> list[HostId]:
    return [HostId(n) for n in names]


# The kernel's replicas are on a, b, c; none has 4 idle GPUs. d has 8 idle, e has 4.
BUSY = cluster(hv("a", 6), hv("b", 8), hv("c", 7), hv("d", 0), hv("e", 4))


def test_the_replica_on_the_busiest_host_moves_to_the_policys_target() -> None:
    request = PlacementRequest(K, 4)
    assert plan_migration(ids("a", "b", "c"), request, BUSY, LeastLoadedPolicy()) == (
        MigrationPlan(K, HostId("b"), HostId("d"))  # most idle GPUs
    )
    assert plan_migration(ids("a", "b", "c"), request, BUSY, BinPackingPolicy()) == (
        MigrationPlan(K, HostId("b"), HostId("e"))  # best fit
    )


def test_it_is_the_plan_a_cell_decision_carries() -> None:
    decision = ClusterDecisions(LeastLoadedPolicy()).cell(BUSY, K, ids("a", "b", "c"), None, 4)
    plan = plan_migration(ids("a", "b", "c"), PlacementRequest(K, 4), BUSY, LeastLoadedPolicy())
    assert decision == plan


def test_hosts_holding_a_replica_or_excluded_are_never_targets() -> None:
    # a (a replica host) has the most idle GPUs; d is excluded by the request.
    view = cluster(hv("a", 0), hv("b", 8), hv("c", 8), hv("d", 0), hv("e", 4))
    request = PlacementRequest(K, 4, exclude=frozenset(ids("d")))
    plan = plan_migration(ids("a", "b", "c"), request, view, LeastLoadedPolicy())
    assert plan == MigrationPlan(K, HostId("b"), HostId("e"))


def test_none_when_no_host_can_commit_the_gpus() -> None:
    view = cluster(hv("a", 8), hv("b", 8), hv("c", 8), hv("d", 5), hv("e", 0, schedulable=False))
    assert (
        plan_migration(ids("a", "b", "c"), PlacementRequest(K, 4), view, LeastLoadedPolicy())
        is None
    )


def test_ties_go_to_the_higher_subscription_then_the_earlier_replica() -> None:
    view = cluster(hv("a", 8, 3), hv("b", 8, 9), hv("c", 8, 9), hv("d", 0))
    plan = plan_migration(ids("a", "b", "c"), PlacementRequest(K, 1), view, LeastLoadedPolicy())
    assert plan is not None
    assert plan.source == HostId("b")


def test_a_replica_on_a_host_missing_from_the_view_moves_first() -> None:
    view = cluster(hv("a", 8), hv("c", 8), hv("d", 0))
    plan = plan_migration(ids("a", "gone", "c"), PlacementRequest(K, 1), view, LeastLoadedPolicy())
    assert plan == MigrationPlan(K, HostId("gone"), HostId("d"))


@pytest.mark.parametrize("replicas", [[], ["a", "a", "b"]])
def test_bad_replica_lists_are_refused(replicas: list[str]) -> None:
    with pytest.raises(PlacementError):
        plan_migration(ids(*replicas), PlacementRequest(K, 1), BUSY, LeastLoadedPolicy())


class FixedTarget:
    """A policy that always answers the same host, whatever the contract says."""

    def __init__(self, target: str) -> None:
        self._target = HostId(target)

    @property
    def name(self) -> str:
        return "fixed"

    def place(self, request: PlacementRequest, cluster: ClusterView) -> Sequence[HostId]:
        return [self._target]

    def migration_target(self, request: PlacementRequest, cluster: ClusterView) -> HostId | None:
        return self._target


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("a", "excluded"),  # holds a replica
        ("zz", "not in the cluster"),
        ("e", "with 4 idle GPUs"),  # asks 5
        ("f", "not schedulable"),
    ],
)
def test_a_policy_breaking_its_contract_is_refused(target: str, why: str) -> None:
    view = cluster(*BUSY.hosts, hv("f", 0, schedulable=False))
    with pytest.raises(PolicyContractError, match=why):
        plan_migration(ids("a", "b", "c"), PlacementRequest(K, 5), view, FixedTarget(target))
