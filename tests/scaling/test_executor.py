"""Executor choice per cell (``ClusterDecisions.cell``): last executor, most idle replica
(hosts in use before idle ones), migrate, wait."""

from __future__ import annotations

import pytest

from nbos.core.errors import GpuError, InsufficientGpusError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView
from nbos.scaling import (
    CellDecision,
    ClusterDecisions,
    Execute,
    LeastLoadedPolicy,
    MigrationPlan,
    Wait,
)

from .conftest import cluster, host

K = KernelId("k-1")
R = [HostId("r1"), HostId("r2"), HostId("r3")]


def decide(
    last: HostId | None, replicas: list[HostId], view: ClusterView, gpus: int
) -> CellDecision:
    return ClusterDecisions(LeastLoadedPolicy()).cell(view, K, replicas, last, gpus)


def test_last_executor_keeps_the_cell_when_its_host_can_commit() -> None:
    view = cluster(host("r1", committed=6), host("r2"), host("r3"))
    assert decide(HostId("r1"), R, view, 2) == Execute(HostId("r1"), "last-executor")


def test_otherwise_the_replica_with_most_idle_gpus() -> None:
    view = cluster(host("r1", committed=7), host("r2", committed=4), host("r3", committed=2))
    assert decide(HostId("r1"), R, view, 2) == Execute(HostId("r3"), "most-idle")
    # Ties go to the earlier replica.
    tied = cluster(host("r1", committed=8), host("r2", committed=2), host("r3", committed=2))
    assert decide(None, R, tied, 1) == Execute(HostId("r2"), "most-idle")


def test_last_executor_that_is_no_longer_a_replica_is_ignored() -> None:
    view = cluster(
        host("gone"), host("r1", committed=5), host("r2", committed=3), host("r3", committed=1)
    )
    choice = decide(HostId("gone"), R, view, 1)
    assert choice == Execute(HostId("r3"), "most-idle")


def test_a_host_with_every_gpu_idle_is_woken_only_when_no_busy_one_can_commit() -> None:
    view = cluster(host("r1", committed=4), host("r2"), host("r3", committed=6))
    assert decide(None, R, view, 2) == Execute(HostId("r1"), "most-idle")
    # Left idle, r2 is where a cell of 8 GPUs can go, and what the autoscaler can drain.
    full = cluster(host("r1", committed=8), host("r2"), host("r3", committed=7))
    assert decide(HostId("r1"), R, full, 2) == Execute(HostId("r2"), "most-idle")
    # The last executor comes first even on an idle host: its tensors may be resident there.
    assert decide(HostId("r2"), R, view, 2) == Execute(HostId("r2"), "last-executor")


def test_migrate_when_only_other_hosts_can_commit() -> None:
    view = cluster(
        host("r1", committed=8),
        host("r2", committed=8),
        host("r3", committed=7),
        host("free"),
        host("draining", schedulable=False),
    )
    # The replica on the busiest host moves (r1 and r2 tie: the earlier), never to a
    # draining host.
    choice = decide(HostId("r1"), R, view, 2)
    assert choice == MigrationPlan(K, HostId("r1"), HostId("free"))


def test_wait_when_no_host_can_commit() -> None:
    view = cluster(host("r1", committed=8), host("r2", committed=7), host("r3", committed=8))
    choice = decide(HostId("r2"), R, view, 2)
    assert isinstance(choice, Wait)
    assert "2 GPUs" in choice.reason


def test_dead_replica_host_is_skipped() -> None:
    view = cluster(host("r1", committed=8), host("r3", committed=3))
    assert decide(HostId("r2"), R, view, 1) == Execute(HostId("r3"), "most-idle")


def test_zero_gpu_cell_runs_on_last_executor_even_on_a_full_host() -> None:
    view = cluster(host("r1", committed=8), host("r2"), host("r3"))
    assert decide(HostId("r1"), R, view, 0) == Execute(HostId("r1"), "last-executor")


def test_more_gpus_than_any_host_has_is_a_clear_error() -> None:
    view = cluster(host("r1"), host("r2"), host("r3", total=4))
    with pytest.raises(InsufficientGpusError) as err:
        decide(None, R, view, 9)
    assert (err.value.requested, err.value.available) == (9, 8)
    assert "no host has that many GPUs" in str(err.value)
    with pytest.raises(GpuError):
        decide(None, R, view, -1)
