"""Property test of the simulator on random small traces and clusters.

For any trace and config: a run is deterministic; the delay percentiles are ordered and
non-negative; GPU time committed covers the work done and, in nbos mode, exceeds it only
by the migrations' delays; the cluster stays within its host limits and never commits more
GPUs than it has; the work done equals the trace's when every cell ran; and once every
session has ended, every host's pool is idle and holds no subscriptions (every path
released what it committed).

Size: ``NBOS_PROPERTY_EXAMPLES`` (default 60).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbos.scaling import (
    Autoscaler,
    AutoscalerConfig,
    Cell,
    ClusterDecisions,
    Session,
    SimConfig,
    Trace,
    simulate,
)
from nbos.scaling.simulator import _Simulation
from nbos.scaling.trace import validated
from tests.property._support import sized

GPUS_PER_HOST = 4


@st.composite
def sessions(draw: st.DrawFn, index: int) -> Session:
    start = draw(st.floats(0, 3600, allow_nan=False))
    length = draw(st.floats(0, 7200, allow_nan=False))
    gpus = draw(st.sampled_from([0, 1, 2, 4]))
    cells = draw(
        st.lists(
            st.tuples(
                st.floats(0, 1, allow_nan=False),
                st.floats(0, 1800, allow_nan=False),
                st.one_of(st.none(), st.integers(0, gpus)),
            ),
            max_size=6,
        )
    )
    return Session(
        f"s{index}",
        start,
        start + length,
        gpus,
        tuple(Cell(start + at * length, duration, g) for at, duration, g in cells),
    )


traces = st.integers(1, 6).flatmap(lambda n: st.tuples(*(sessions(i) for i in range(n))).map(Trace))

autoscalers = st.one_of(
    st.none(),
    st.builds(
        AutoscalerConfig,
        min_hosts=st.integers(1, 4),
        max_hosts=st.integers(4, 8),
        idle_grace=st.sampled_from([0.0, 300.0]),
        scale_in_cooldown=st.sampled_from([0.0, 300.0]),
    ),
)


@st.composite
def configs(draw: st.DrawFn) -> SimConfig:
    policy = draw(st.sampled_from(["least-loaded", "bin-packing", "random"]))
    return SimConfig(
        hosts=draw(st.integers(0, 5)),
        gpus_per_host=GPUS_PER_HOST,
        mode=draw(st.sampled_from(["nbos", "reservation"])),
        policy=policy,
        policy_kwargs={"seed": 1} if policy == "random" else {},
        autoscaler=draw(autoscalers),
        overrun_limit=3600.0,
    )


@sized()
@given(trace=traces, config=configs())
def test_simulator_invariants(trace: Trace, config: SimConfig) -> None:
    result = simulate(trace, config)
    assert simulate(trace, config) == result

    assert 0 <= result.delay_p50 <= result.delay_p95 <= result.delay_p99
    assert 0 <= result.interactive_share <= 1
    assert result.gpu_hours_reserved >= result.gpu_hours_busy - 1e-9
    if config.mode == "nbos":
        # GPUs committed and not yet busy: a migration's, and every cell's commit.
        moving = result.migrations * config.migration_time * GPUS_PER_HOST
        slack = (moving + len(result.delays) * config.gpu_commit * GPUS_PER_HOST) / 3600
        assert result.gpu_hours_reserved <= result.gpu_hours_busy + slack + 1e-9
    if result.cells_unserved == 0:
        assert result.gpu_hours_busy == pytest.approx(trace.gpu_hours_busy())
    assert result.peak_gpus_committed <= result.hosts_max * GPUS_PER_HOST
    if config.autoscaler is not None:
        assert result.hosts_max <= max(config.hosts, config.autoscaler.max_hosts)
    else:
        assert result.hosts_timeline == ((0.0, config.hosts),)
    assert all(count >= 0 for _, count in result.hosts_timeline)


@sized()
@given(trace=traces, config=configs())
def test_every_path_releases_what_it_committed(trace: Trace, config: SimConfig) -> None:
    autoscaler = Autoscaler(config.autoscaler) if config.autoscaler else None
    decisions = ClusterDecisions.load(config.policy, 3, autoscaler, **config.policy_kwargs)
    sim = _Simulation(validated(trace), config, decisions)
    sim.run()
    # The end state is the property: the overrun limit ends waiting work, so even a run
    # that left cells unserved must have released everything.
    for host_id, pool in sim.pools.items():
        counts = pool.counts()
        assert counts.idle == counts.total, host_id
        view = sim.model.host(host_id)
        assert (view.gpus_committed, view.gpus_subscribed, view.replicas) == (0, 0, 0), host_id
