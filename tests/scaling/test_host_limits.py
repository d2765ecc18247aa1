"""What one host takes (replicas, free memory): one rule in the cluster model, which every
policy and the simulator decide on, as the gateway does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbos.core.config import ClusterSettings
from nbos.core.errors import ConfigError, PlacementError, PolicyContractError
from nbos.core.ids import HostId, KernelId
from nbos.scaling import (
    ClusterDecisions,
    ClusterModel,
    HostLimits,
    SimConfig,
    available_policies,
    simulate,
)
from nbos.scaling.timings import Timings
from nbos.scaling.trace import Cell, Session, Trace

HOSTS = tuple(HostId(f"h{i}") for i in range(5))
POLICIES = sorted(available_policies())

# One step: place a kernel (its GPUs), end the n-th kernel placed, or set a host's memory.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 2)),
        st.tuples(st.just("forget"), st.integers(0, 20)),
        st.tuples(st.just("memory"), st.sampled_from(HOSTS), st.none() | st.integers(0, 2000)),
    ),
    max_size=40,
)


def _room(model: ClusterModel, limits: HostLimits, memory: dict[HostId, int | None]) -> int:
    """Hosts with room for one more replica, counted from the rule as the docs state it."""
    return sum(
        (limits.max_replicas is None or len(model.kernels_on(h)) < limits.max_replicas)
        and (memory[h] is None or memory[h] >= limits.min_free_memory_mib)
        for h in HOSTS
    )


@given(
    policy=st.sampled_from([p for p in POLICIES if p in ("least-loaded", "bin-packing", "random")]),
    most=st.integers(1, 4),
    floor=st.integers(0, 1000),
    script=steps,
)
def test_no_policy_places_past_a_hosts_limits_and_one_fails_only_without_room(
    policy: str, most: int, floor: int, script: list[tuple[object, ...]]
) -> None:
    limits = HostLimits(most, floor)
    model = ClusterModel(3, limits)
    decisions = ClusterDecisions.load(policy)
    memory: dict[HostId, int | None] = dict.fromkeys(HOSTS)
    for h in HOSTS:
        model.add_host(h, 4)
    placed: list[KernelId] = []
    for n, step in enumerate(script):
        if step[0] == "place":
            kernel = KernelId(f"k{n}")
            room = _room(model, limits, memory)
            try:
                hosts = decisions.place(model.view(), kernel, int(step[1]))
            except PolicyContractError:
                raise
            except PlacementError:
                # Refused only for want of room: a host's limits, or the GPU subscription
                # admission (which only kernels with GPUs meet).
                assert room < 3 or step[1] != 0, (room, limits)
                continue
            assert all(h not in model.full_hosts() for h in hosts), (hosts, limits)
            model.place(kernel, hosts, int(step[1]))
            placed.append(kernel)
        elif step[0] == "forget" and placed:
            model.forget(placed.pop(int(step[1]) % len(placed)))
        elif step[0] == "memory":
            host, mib = HostId(str(step[1])), step[2]
            memory[host] = mib
            model.set_free_memory(host, mib)
        for h in HOSTS:
            full = limits.full(len(model.kernels_on(h)), memory[h])
            assert model.host(h).schedulable is not full
        assert model.schedulable_hosts == _room(model, limits, memory)
        assert all(len(model.kernels_on(h)) <= most for h in HOSTS)


def test_a_full_host_still_runs_its_replicas_cells_but_takes_no_moved_replica() -> None:
    model = ClusterModel(3, HostLimits(max_replicas=1))
    decisions = ClusterDecisions.load("least-loaded")
    for h in HOSTS[:4]:
        model.add_host(h, 2)
    model.place(KernelId("a"), HOSTS[:3], 1)
    assert model.full_hosts() == list(HOSTS[:3])
    # The cell runs where its replica is, though that host is full.
    cell = decisions.cell(model.view(), KernelId("a"), HOSTS[:3], HOSTS[0], 1)
    assert getattr(cell, "host", None) == HOSTS[0]
    with pytest.raises(PlacementError, match=r"\(3 full\)"):
        decisions.place(model.view(), KernelId("b"), 0)
    assert decisions.place_one(model.view(), KernelId("a"), 1, HOSTS[:3]) == HOSTS[3]
    model.forget(KernelId("a"))
    assert model.full_hosts() == [] and model.schedulable_hosts == 4


def test_the_simulator_keeps_to_the_same_limits() -> None:
    """Two sessions at once on 3 hosts that take one replica each: the second kernel is
    placed only once the first one's session ended, so its cell waits that long."""
    sessions = (
        Session("a", 0.0, 1000.0, 1, (Cell(0.0, 100.0),)),
        Session("b", 10.0, 3000.0, 1, (Cell(20.0, 100.0),)),
    )
    trace = Trace(sessions)

    def delay(limits: HostLimits) -> float:
        config = SimConfig(hosts=3, gpus_per_host=2, autoscaler=None, host_limits=limits)
        config = config.timed(
            Timings(host_startup=0, migration_time=0, gpu_commit=0, kernel_start=0)
        )
        return simulate(trace, config).delay_p99

    assert delay(HostLimits()) < 1.0
    # The p99 of b's wait (980 s, until a's session stopped) and a's none.
    assert delay(HostLimits(max_replicas=1)) > 900.0


def test_settings_become_limits_and_bad_ones_are_refused() -> None:
    assert HostLimits.of(ClusterSettings()) == HostLimits(64, 256)
    assert HostLimits.of(ClusterSettings(max_replicas_per_host=0, min_free_memory_mib=0)) == (
        HostLimits()
    )
    with pytest.raises(ConfigError, match=r"cluster\.max_replicas_per_host"):
        HostLimits.of(ClusterSettings(max_replicas_per_host=-2))
    with pytest.raises(ConfigError, match=r"cluster\.min_free_memory_mib"):
        HostLimits.of(ClusterSettings(min_free_memory_mib=-1))
    for bad in ({"max_replicas": 0}, {"max_replicas": True}, {"min_free_memory_mib": 1.5}):
        with pytest.raises(ConfigError):
            HostLimits(**bad)
