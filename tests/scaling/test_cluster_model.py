"""The one cluster model's live surface, and the rules the decisions hold for both sides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbos.core.errors import PlacementError
from nbos.core.ids import HostId, KernelId
from nbos.scaling import Autoscaler, AutoscalerConfig, ClusterDecisions, ClusterModel

H0, H1, H2, H3 = (HostId(f"h{i}") for i in range(4))


def model(*hosts: HostId, gpus: int = 4) -> ClusterModel:
    m = ClusterModel()
    for h in hosts:
        m.add_host(h, gpus)
    return m


def test_a_placement_on_a_host_not_yet_in_the_cluster_counts_once_it_joins() -> None:
    m = model(H0, H1)
    m.place(KernelId("k"), (H0, H1, H2), 2)
    assert [h.host_id for h in m.view().hosts] == [H0, H1]
    m.add_host(H2, 4)
    assert (m.host(H2).gpus_subscribed, m.host(H2).replicas) == (2, 1)
    m.set_schedulable(H2, False)
    m.remove_host(H2)  # a host may leave while a kernel names it: kept aside again
    m.add_host(H2, 8)
    assert (m.host(H2).gpus_total, m.host(H2).replicas, m.host(H2).schedulable) == (8, 1, True)
    m.forget(KernelId("k"))
    assert m.host(H2).gpus_subscribed == 0


def test_held_gpus_count_as_committed_and_a_suspected_host_is_not_schedulable() -> None:
    m = model(H0)
    m.set_gpus(H0, 4, 1)
    m.hold(H0, 2)
    assert (m.host(H0).gpus_committed, m.committed, m.could_commit(2, schedulable=True)) == (
        3,
        1,
        False,
    )
    m.hold(H0, -2)
    m.set_suspected(H0, True)
    assert not m.host(H0).schedulable
    assert (m.schedulable_hosts, m.draining(), m.is_draining(H0)) == (0, [], False)
    m.set_suspected(H0, False)
    m.set_schedulable(H0, False)
    assert m.is_draining(H0)


def test_a_cell_runs_off_draining_hosts_unless_all_its_replicas_drain() -> None:
    m = model(H0, H1, H2)
    m.set_schedulable(H0, False)
    assert ClusterDecisions.off_draining((H0, H1, H2), m.is_draining) == [H1, H2]
    m.set_schedulable(H1, False)
    m.set_schedulable(H2, False)
    assert ClusterDecisions.off_draining((H0, H1, H2), m.is_draining) == (H0, H1, H2)


def test_a_failed_placement_counts_once_and_work_waiting_at_the_ceiling_is_told() -> None:
    config = AutoscalerConfig(min_hosts=1, max_hosts=2, scale_out_cooldown=0)
    decisions = ClusterDecisions.load("least-loaded", autoscaler=Autoscaler(config))
    m = model(H0, H1)
    with pytest.raises(PlacementError):
        decisions.place(m.view(), KernelId("k"), 1)  # 3 replicas, 2 hosts

    def at_ceiling(now: float, cells_waiting: bool = False) -> bool:
        step = decisions.scale(
            m.view(), now, cells_waiting=cells_waiting, kernels_waiting=False, provisioning=0
        )
        return step.at_ceiling

    assert (at_ceiling(0.0), at_ceiling(1.0), at_ceiling(2.0, cells_waiting=True)) == (
        True,
        False,
        True,
    )


def test_kernels_without_gpus_spread_over_the_hosts_by_replicas() -> None:
    # Issue 30: three 0-GPU kernels on 4 hosts all went to the same 3 (their ratios tie).
    m = model(H0, H1, H2, H3)
    decisions = ClusterDecisions.load("least-loaded", 3)
    for i in range(3):
        kernel = KernelId(f"k{i}")
        m.place(kernel, decisions.place(m.view(), kernel, 0), 0)
    assert sorted(m.host(h).replicas for h in (H0, H1, H2, H3)) == [2, 2, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.lists(st.integers(0, 1), min_size=1, max_size=12))
def test_least_loaded_keeps_replicas_per_host_within_one_among_equal_hosts(
    hosts: int, kernels: list[int]
) -> None:
    # Equal hosts, kernels of 0 or 1 GPU in any order, no cell running: every host ends
    # with as many replicas as any other, give or take one.
    ids = [HostId(f"h{i}") for i in range(hosts)]
    m = model(*ids, gpus=8)
    decisions = ClusterDecisions.load("least-loaded", 3)
    for i, gpus in enumerate(kernels):
        kernel = KernelId(f"k{i}")
        m.place(kernel, decisions.place(m.view(), kernel, gpus), gpus)
    if len(set(kernels)) == 1:
        counts = [m.host(h).replicas for h in ids]
        assert max(counts) - min(counts) <= 1, counts
