"""The simulator on small traces with outcomes worked out by hand, the trace formats and the CLI."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import msgspec
import pytest

from nbos.cli import simulate as simulate_cli
from nbos.cli.main import main
from nbos.core.errors import ConfigError, ScalingError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView
from nbos.scaling import (
    AutoscalerConfig,
    Cell,
    Session,
    SimConfig,
    Trace,
    load_trace,
    simulate,
    synthetic_trace,
)
from nbos.scaling.decisions import ClusterDecisions
from nbos.scaling.delays import DelaySplit
from nbos.scaling.limits import HostLimits
from nbos.scaling.model import ClusterModel
from nbos.scaling.registry import load_policy
from nbos.scaling.timings import Timings
from nbos.scaling.trace import dump_csv, dump_json, parse_csv, parse_json

#: nbos's own work taking no time: the outcomes below are worked out by hand without it.
INSTANT = Timings(host_startup=0, migration_time=0, gpu_commit=0, kernel_start=0)


def fixed(mode: str = "nbos", hosts: int = 3, gpus: int = 1, **kw: object) -> SimConfig:
    """A cluster that never scales, whose own work takes no time unless ``kw`` says."""
    config = SimConfig(hosts=hosts, gpus_per_host=gpus, mode=mode, autoscaler=None).timed(INSTANT)
    return attrs.evolve(config, **kw)


# Two 1-GPU sessions alive from 0 to 1000 s whose cells never overlap.
TAKING_TURNS = Trace(
    (
        Session("a", 0, 1000, 1, (Cell(10, 100), Cell(300, 100))),
        Session("b", 0, 1000, 1, (Cell(150, 100), Cell(500, 100))),
    )
)


def test_sessions_taking_turns_share_one_gpu_in_nbos_but_hold_two_when_reserving() -> None:
    nbos = simulate(TAKING_TURNS, fixed("nbos"))
    reserving = simulate(TAKING_TURNS, fixed("reservation"))
    assert nbos.peak_gpus_committed == 1
    assert reserving.peak_gpus_committed == 2
    # 4 cells of 100 s on 1 GPU: busy 400 GPU-s either way.
    assert nbos.gpu_hours_busy == reserving.gpu_hours_busy == pytest.approx(400 / 3600)
    # nbos commits only while cells run; the baseline holds 2 GPUs for 1000 s.
    assert nbos.gpu_hours_reserved == pytest.approx(400 / 3600)
    assert reserving.gpu_hours_reserved == pytest.approx(2000 / 3600)
    assert nbos.busy_share == pytest.approx(1.0)
    assert reserving.busy_share == pytest.approx(0.2)
    for r in (nbos, reserving):
        assert (r.delay_p50, r.delay_p99, r.interactive_share) == (0.0, 0.0, 1.0)
        assert r.gpu_hours_provisioned == pytest.approx(3 * 1000 / 3600)
        assert r.hosts_timeline == ((0.0, 3),)


def test_a_reservation_waits_for_a_gpu_and_so_do_its_cells() -> None:
    # One 1-GPU host: b's session gets the GPU when a's ends at 100; its cell was ready at 10.
    trace = Trace(
        (
            Session("a", 0, 100, 1, (Cell(5, 50),)),
            Session("b", 0, 200, 1, (Cell(10, 5),)),
        )
    )
    r = simulate(trace, fixed("reservation", hosts=1))
    assert sorted([r.delay_p50, r.delay_p99]) == [pytest.approx(45.0), pytest.approx(89.1)]
    assert r.interactive_share == 0.5
    assert r.gpu_hours_reserved == pytest.approx((100 + 100) / 3600)


def test_cells_of_one_kernel_run_one_after_another() -> None:
    # The second cell is submitted while the first runs: it is ready at 110, not delayed.
    trace = Trace((Session("a", 0, 500, 1, (Cell(10, 100), Cell(50, 10))),))
    r = simulate(trace, fixed("nbos"))
    assert (r.delay_p50, r.delay_p99) == (0.0, 0.0)
    assert r.hours == pytest.approx(500 / 3600)


def migration_trace() -> Trace:
    """Kernels a, b, c keep all three hosts' GPUs busy from ~10 s to ~10010 s; k's cell at 20 s
    finds its replicas' hosts full."""
    long_cells = [
        Session(name, start, 20000, 1, (Cell(10 + start, 10000),))
        for start, name in enumerate("abc")
    ]
    return Trace((*long_cells, Session("k", 3, 20000, 1, (Cell(20, 30),))))


def test_a_cell_whose_replica_hosts_are_full_migrates_to_a_new_host_which_is_later_removed() -> (
    None
):
    config = SimConfig(hosts=3, gpus_per_host=1, autoscaler=AutoscalerConfig()).timed(
        Timings(host_startup=60.0, migration_time=10.0, gpu_commit=0.0, kernel_start=0.0)
    )
    r = simulate(migration_trace(), config)
    # t=20: k waits (no other host). Tick t=60: scale out by one (placement failed).
    # t=120: the host joins, k's replica on the busiest host moves there and the cell
    # starts after the 10 s migration: delay 130 - 20 = 110 s.
    assert (r.scale_outs, r.migrations) == (1, 1)
    # Delays 0, 0, 0, 110; percentiles interpolate between ranks: p99 = 0.97 * 110.
    assert r.delay_p50 == 0.0
    assert r.delay_p99 == pytest.approx(106.7)
    assert r.interactive_share == 0.75
    # k's cell ends at 160; a, b, c's at 10010-10012. Tick 10020: load 0, the new host has
    # been idle > 600 s: it is drained (k's replica moves back, taking the 10 s of a
    # migration, as live) and removed at 10030. No thrashing.
    assert r.hosts_timeline == ((0.0, 3), (120.0, 4), (10030.0, 3))
    assert (r.scale_ins, r.drain_moves) == (1, 1)
    assert r.hosts_max == 4


def test_without_a_spare_host_the_cell_waits_for_a_gpu() -> None:
    r = simulate(migration_trace(), fixed("nbos"))
    # k's cell waits from 20 s until a's cell ends at 10010 s: delays 0, 0, 0, 9990.
    assert r.migrations == 0
    assert r.hosts_timeline == ((0.0, 3),)
    assert r.delay_p50 == 0.0
    assert r.delay_p99 == pytest.approx(0.97 * 9990)


def test_work_that_can_never_be_placed_ends_the_run_as_unserved() -> None:
    # Two hosts cannot hold 3 replicas and nothing scales: the kernel never starts.
    trace = Trace((Session("a", 0, 100, 1, (Cell(10, 5), Cell(50, 5))),))
    r = simulate(trace, fixed("nbos", hosts=2, overrun_limit=600.0))
    assert (r.cells, r.cells_unserved, r.interactive_share) == (2, 2, 0.0)
    assert r.hours * 3600 <= 100 + 600 + 60  # ticks stopped after the overrun limit
    assert hash(fixed()) == hash(fixed())


def test_runs_are_deterministic() -> None:
    trace = synthetic_trace(8, 6.0, seed=3)
    config = SimConfig(hosts=3, policy="random", policy_kwargs={"seed": 5})
    assert simulate(trace, config) == simulate(trace, config)
    assert synthetic_trace(8, 6.0, seed=3) == trace
    assert synthetic_trace(8, 6.0, seed=4) != trace


def test_a_run_takes_the_decisions_and_the_model_it_is_given() -> None:
    placed: list[tuple[KernelId, int]] = []

    class Watched(ClusterDecisions):
        def place(
            self, cluster: ClusterView, kernel_id: KernelId, gpus: int, exclude: Any = ()
        ) -> tuple[HostId, ...]:
            placed.append((kernel_id, gpus))
            return super().place(cluster, kernel_id, gpus, exclude)

    model = ClusterModel(3)
    result = simulate(
        TAKING_TURNS, fixed(), decisions=Watched(load_policy("least-loaded")), model=model
    )
    assert len(placed) == 2 and {gpus for _, gpus in placed} == {1}
    assert len(model.hosts) == 3 and result == simulate(TAKING_TURNS, fixed())
    with pytest.raises(ScalingError, match="must start empty"):
        simulate(TAKING_TURNS, fixed(), model=model)


def test_the_default_synthetic_trace_matches_the_papers_summary() -> None:
    trace = synthetic_trace()
    assert len(trace.sessions) == 59
    assert trace.end <= 48 * 3600
    assert 4000 < trace.gpu_hours_reserved() < 6500  # paper: 5,070
    assert 0.22 < trace.gpu_hours_busy() / trace.gpu_hours_reserved() < 0.30  # paper: 0.26


def test_nbos_needs_fewer_gpu_hours_than_reservation_on_a_synthetic_trace() -> None:
    trace = synthetic_trace(12, 8.0, seed=1)
    nbos = simulate(trace, SimConfig(mode="nbos"))
    reserving = simulate(trace, SimConfig(mode="reservation"))
    assert nbos.gpu_hours_busy == pytest.approx(reserving.gpu_hours_busy)
    assert nbos.gpu_hours_reserved < reserving.gpu_hours_reserved
    assert nbos.gpu_hours_provisioned < reserving.gpu_hours_provisioned
    assert nbos.cells_unserved == reserving.cells_unserved == 0


# --- bad input ---------------------------------------------------------------------------


def test_a_session_larger_than_a_host_is_refused() -> None:
    trace = Trace((Session("big", 0, 10, 16),))
    with pytest.raises(ScalingError, match="more than the 8 GPUs"):
        simulate(trace, SimConfig())


@pytest.mark.parametrize(
    "kwargs", [{"mode": "cloud"}, {"gpus_per_host": 0}, {"tick": 0.0}, {"hosts": -1}]
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SimConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "session",
    [
        Session("s", 10, 5, 1),  # stops before it starts
        Session("s", 0, 10, 1, (Cell(11, 1),)),  # cell after the stop
        Session("s", 0, 10, 1, (Cell(1, -1),)),  # negative duration
        Session("s", 0, 10, 1, (Cell(1, 1, 2),)),  # more GPUs than the session
    ],
)
def test_malformed_sessions_are_refused(session: Session) -> None:
    with pytest.raises(ScalingError):
        simulate(Trace((session,)), SimConfig())


def test_duplicate_session_ids_are_refused() -> None:
    with pytest.raises(ScalingError, match="twice"):
        simulate(Trace((Session("s", 0, 1, 1), Session("s", 0, 1, 1))), SimConfig())


# --- trace files -------------------------------------------------------------------------


def test_json_and_csv_round_trip(tmp_path: Path) -> None:
    trace = Trace((Session("a", 0, 100, 2, (Cell(5, 10), Cell(20, 5, 1))), Session("b", 1, 2, 0)))
    (tmp_path / "t.json").write_bytes(dump_json(trace))
    (tmp_path / "t.csv").write_text(dump_csv(trace))
    assert load_trace(tmp_path / "t.json") == trace
    assert load_trace(tmp_path / "t.csv") == trace


def test_loaders_sort_cells_by_submit_time() -> None:
    text = "session,event,time,duration,gpus\ns,start,0,,1\ns,cell,9,1,\ns,cell,3,1,\ns,stop,10,,\n"
    assert [c.start for c in parse_csv(text).sessions[0].cells] == [3.0, 9.0]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("session,event,time\n", "header"),
        ("session,event,time,duration,gpus\ns,start,0,,1\n", "without both"),
        ("session,event,time,duration,gpus\ns,start,0,,1\ns,stop,x,,\n", "not a number"),
        ("session,event,time,duration,gpus\ns,begin,0,,1\n", "not start, stop or cell"),
        ("session,event,time,duration,gpus\ns,start,0,,1\ns,start,1,,1\n", "second start"),
        ("session,event,time,duration,gpus\ns,start,0,,one\ns,stop,1,,\n", "not an integer"),
        ("session,event,time,duration,gpus\ns,start,0,,1\ns,stop,inf,,\n", "not finite"),
    ],
)
def test_bad_csv_is_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(ScalingError, match=why):
        parse_csv(text)


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b'{"sessions": [{"id": "s", "start": 0}]}',
        b'{"sessions": [], "extra": 1}',
        b'{"sessions": [{"id": "s", "start": 0, "stop": 1, "gpus": -1}]}',
    ],
)
def test_bad_json_is_refused(data: bytes) -> None:
    with pytest.raises(ScalingError):
        parse_json(data)


def test_unknown_suffix_and_missing_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("sessions: []")
    with pytest.raises(ScalingError, match="unknown format"):
        load_trace(tmp_path / "t.yaml")
    with pytest.raises(ScalingError, match="cannot read"):
        load_trace(tmp_path / "missing.json")


# --- CLI and user policies ---------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    simulate_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    code: int = args.func(args)
    return code


def test_cli_prints_both_modes_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "t.json").write_bytes(dump_json(TAKING_TURNS))
    (tmp_path / "instant.toml").write_text(INSTANT.as_toml())
    argv = ["--trace", str(tmp_path / "t.json"), "--hosts", "3", "--gpus-per-host", "1"]
    argv += ["--timings", str(tmp_path / "instant.toml")]
    assert run_cli([*argv, "--no-autoscale"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "nbos", "reservation"]
    assert any(line.split()[:3] == ["peak", "GPUs", "committed"] and line.split()[3:] == ["1", "2"]
               for line in lines)  # fmt: skip
    assert run_cli([*argv, "--mode", "nbos", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["mode"], row["peak_gpus_committed"], row["busy_share"]) == ("nbos", 1, 1.0)


def test_nbos_simulate_through_the_main_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--synthetic", "2", "--hours", "1", "--mode", "nbos", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["mode"], row["sessions"]) == ("nbos", 2)
    (tmp_path / "bad.csv").write_text("session,event\n")
    assert main(["simulate", "--trace", str(tmp_path / "bad.csv")]) == 1
    assert "header must name" in capsys.readouterr().err


def test_cli_refuses_a_malformed_policy_argument() -> None:
    with pytest.raises(ConfigError):
        run_cli(["--synthetic", "1", "--hours", "1", "--policy-arg", "no-equals-sign"])


@pytest.fixture
def example_policy(
    installed_policy: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[None]:
    """The example package on sys.path for one test, and forgotten after it, so that
    test_user_policy imports its own copy."""
    monkeypatch.syspath_prepend(str(installed_policy))
    yield
    for name in [m for m in sys.modules if m.partition(".")[0] == "nbos_example_policy"]:
        del sys.modules[name]


@pytest.mark.usefixtures("example_policy")
def test_a_user_policy_from_an_entry_point_runs_in_the_simulator() -> None:
    trace = synthetic_trace(6, 4.0, seed=2)
    config = SimConfig(hosts=4, policy="spread-by-name", policy_kwargs={"salt": "x"})
    result = simulate(trace, config)
    assert result.policy == "spread-by-name"
    assert result.cells_unserved == 0
    assert result.gpu_hours_busy == pytest.approx(trace.gpu_hours_busy())
    assert simulate(trace, config) == result  # the user policy replays too


def test_the_delay_split_counts_gpus_the_host_being_added_and_the_migration() -> None:
    config = SimConfig(hosts=3, gpus_per_host=1, autoscaler=AutoscalerConfig()).timed(
        Timings(host_startup=60.0, migration_time=10.0, gpu_commit=0.0, kernel_start=0.0)
    )
    r = simulate(migration_trace(), config)
    # k's cell waits from 20 s; the autoscaler asks for a host at 60 s, which joins at
    # 120 s; the replica's move takes 10 s: 40 s for GPUs, 60 s for the host, 10 s moving.
    assert r.delay_split == DelaySplit(gpus=40.0, scale_out=60.0, migration=10.0)
    assert r.delay_split.total == pytest.approx(sum(r.delays))


def test_a_cell_behind_a_late_cell_of_its_kernel_is_split_as_queue() -> None:
    base = migration_trace()
    k = base.sessions[-1]
    trace = Trace(
        (*base.sessions[:-1], msgspec.structs.replace(k, cells=(Cell(20, 30), Cell(25, 5))))
    )
    r = simulate(trace, fixed("nbos"))
    # k's first cell waits 20..10010 for a GPU; its second was due at 50 (after the first's
    # ideal end) and is ready once the first ended at 10040: it waited behind it.
    assert r.delay_split == DelaySplit(queue=10040.0 - 50.0, gpus=9990.0)


def test_a_drained_hosts_replicas_move_off_one_after_another_each_taking_a_migration() -> None:
    """Once idle for its grace, a host holding two kernels' replicas is drained, and it
    leaves after two drain moves of ``migration_time`` each, one after the other (the
    gateway's drain moves one replica at a time). Before, the moves took no time."""
    trace = Trace(tuple(Session(name, 0, 5000, 1, (Cell(10, 100),)) for name in "abc"))
    scaler = AutoscalerConfig(min_hosts=3, idle_grace=600, scale_in_cooldown=0)
    config = SimConfig(hosts=4, gpus_per_host=2, autoscaler=scaler, tick=60.0).timed(
        Timings(host_startup=0.0, migration_time=45.0, gpu_commit=0.0, kernel_start=0.0)
    )
    r = simulate(trace, config)
    # Tick 600: h001 (two replicas, never committed) drained; its replicas move off from
    # 600 to 645 and from 645 to 690, when it goes.
    assert (r.scale_ins, r.drain_moves) == (1, 2)
    assert r.hosts_timeline == ((0.0, 4), (690.0, 3))


def test_a_kernels_start_and_a_cells_commit_are_nbos_own_overhead_not_waits() -> None:
    # The session's first cell comes as it opens (as in a task trace): it waits 5 s for
    # its kernel's start and 0.5 s for its GPUs' commit, nbos's own work, not other cells'.
    trace = Trace((Session("a", 0, 100, 1, (Cell(0, 10),)),))
    timings = Timings(host_startup=0, migration_time=0, gpu_commit=0.5, kernel_start=5)
    r = simulate(trace, fixed("nbos").timed(timings))
    assert r.delay_split == DelaySplit(overhead=5.5)
    assert r.delays == (5.5,)


def test_a_kernel_waiting_for_room_waits_for_gpus_then_for_its_own_start() -> None:
    # Three hosts with room for one replica each: b's kernel, asked for at 10, is placed once
    # a's stops at 100 (a wait for room, as for GPUs), then takes 5 s to start (its own).
    limits = HostLimits(max_replicas=1)
    trace = Trace(
        (
            Session("a", 0, 100, 1, (Cell(0, 50),)),
            Session("b", 10, 300, 1, (Cell(10, 10),)),
        )
    )
    timings = Timings(host_startup=0, migration_time=0, gpu_commit=0, kernel_start=5)
    r = simulate(trace, fixed("nbos", host_limits=limits).timed(timings))
    assert r.delays == (5.0, 95.0)
    assert r.delay_split == DelaySplit(gpus=90.0, overhead=10.0)


def test_a_simulated_replay_counts_its_delays_at_1x_as_the_replay_does() -> None:
    # As nbos replay --speedup 60 --simulate: the kernel's 0.5 s start takes 30 s of trace,
    # which the first cell waits and the second, behind it, inherits. At 1x a user would
    # feel 0.5 s of nbos's own for the first and the same carried over for the second.
    trace = Trace((Session("a", 0, 1000, 1, (Cell(0, 60), Cell(60, 60))),))
    timings = Timings(host_startup=0, migration_time=0, gpu_commit=0, kernel_start=0.5)
    config = fixed("nbos").replaying(timings, 60.0)
    r = simulate(trace, config)
    assert r.delays == (30.0, 30.0)
    assert r.delay_split == DelaySplit(queue=30.0, overhead=30.0)
    assert (r.interactive_share, r.interactive_share_1x) == (0.0, 1.0)
    # At the trace's own speed the share at 1x is the share.
    plain = simulate(trace, fixed("nbos").timed(timings))
    assert plain.interactive_share_1x == plain.interactive_share == 1.0


def test_a_simulation_refuses_a_speedup_that_is_not_positive() -> None:
    with pytest.raises(ConfigError, match="speedup"):
        SimConfig(speedup=0)


def test_cli_spare_hosts_need_the_autoscaler_and_a_count_it_can_keep() -> None:
    argv = ["--synthetic", "1", "--hours", "1", "--mode", "nbos", "--json"]
    with pytest.raises(ConfigError, match="--spare-hosts"):
        run_cli([*argv, "--no-autoscale", "--spare-hosts", "1"])
    for bad in ("-1", "65"):
        with pytest.raises(ConfigError, match="--spare-hosts"):
            run_cli([*argv, "--spare-hosts", bad])
    with pytest.raises(ConfigError, match="--gpus-per-host"):
        run_cli([*argv, "--gpus-per-host", "0"])
    assert run_cli([*argv, "--spare-hosts", "1"]) == 0
