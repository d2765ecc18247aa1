"""Pre-copy (``SimConfig.precopy``, ``ClusterDecisions.precopy``): a replica copied ahead of an
idle kernel's next cell takes that cell's migration off its critical path."""

from __future__ import annotations

import attrs

from nbos.core.ids import HostId, KernelId
from nbos.scaling import AutoscalerConfig, Cell, ClusterModel, Session, SimConfig, Trace, simulate
from nbos.scaling.decisions import ClusterDecisions
from nbos.scaling.migration import MigrationPlan
from nbos.scaling.timings import Timings

MIGRATION_S = 10.0


def busy_hosts_trace() -> Trace:
    """Kernels a, b, c keep the three first hosts' GPUs busy from ~10 s to ~10010 s; k, placed
    on those hosts, sends its one cell at 200 s, after a fourth host joined (at 60 s)."""
    long_cells = [
        Session(name, start, 20000, 1, (Cell(10 + start, 10000),))
        for start, name in enumerate("abc")
    ]
    return Trace((*long_cells, Session("k", 3, 20000, 1, (Cell(200, 30),))))


def config(*, precopy: bool) -> SimConfig:
    timings = Timings(host_startup=0, migration_time=MIGRATION_S, gpu_commit=0, kernel_start=0)
    base = SimConfig(hosts=3, gpus_per_host=1, autoscaler=AutoscalerConfig()).timed(timings)
    return attrs.evolve(base, precopy=precopy)


def test_without_precopy_the_cell_waits_for_its_migration() -> None:
    r = simulate(busy_hosts_trace(), config(precopy=False))
    assert r.migrations == 1
    assert sorted(r.delays) == [0, 0, 0, MIGRATION_S]


def test_with_precopy_the_cell_on_a_kernel_whose_hosts_are_full_starts_at_once() -> None:
    r = simulate(busy_hosts_trace(), config(precopy=True))
    # The same one move, made at a tick while k was idle, and finished before its cell.
    assert r.migrations == 1
    assert r.delays == (0, 0, 0, 0)
    assert r.hosts_timeline == simulate(busy_hosts_trace(), config(precopy=False)).hosts_timeline


def test_precopy_is_the_move_a_cell_would_make_and_only_when_it_would_make_one() -> None:
    model = ClusterModel(3)
    for h in ("h0", "h1", "h2", "h3"):
        model.add_host(HostId(h), 1)
    k = KernelId("k")
    model.place(k, [HostId("h0"), HostId("h1"), HostId("h2")], 1)
    decisions = ClusterDecisions.load("least-loaded")
    hosts = model.replica_hosts(k)
    # A replica's host has its GPU idle: nothing to copy.
    assert decisions.precopy(model.view(), k, hosts, 1) is None
    for h in hosts:
        model.commit(h, 1)
    plan = decisions.precopy(model.view(), k, hosts, 1)
    assert isinstance(plan, MigrationPlan) and plan.target == "h3"
    assert plan == decisions.cell(model.view(), k, hosts, None, 1)
    # No GPUs asked, or no host to copy to: nothing.
    assert decisions.precopy(model.view(), k, hosts, 0) is None
    model.commit(HostId("h3"), 1)
    assert decisions.precopy(model.view(), k, hosts, 1) is None
