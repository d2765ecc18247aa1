"""``nbos replay``: a tiny trace on a live gateway; its figures are the gateway's accounting."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbos.cli import replay as replay_cli
from nbos.cli import simulate as simulate_cli
from nbos.gateway import replay
from nbos.gateway.control_api import Usage, UsageRequest, call
from nbos.gateway.replay import ReplayConfig, ReplayRun
from nbos.gateway.service import GatewayService
from nbos.scaling import results, simulator
from nbos.scaling.ledger import CellUsage, HostCount, Totals
from nbos.scaling.timings import Timings
from nbos.scaling.trace import Cell, Session, Trace, dump_json
from tests._wait import eventually
from tests.agent._daemons import DEADLINE, ROOT
from tests.gateway._service import autoscaled_settings, local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

# An hour of trace a second: GPU-hours the table shows as whole numbers.
SPEEDUP = 3600.0
TRACE = Trace(
    (
        Session("a", 0, 9 * 3600, 2, (Cell(1800, 3600, 1), Cell(7200, 3600))),
        Session("b", 600, 8 * 3600, 1, (Cell(3600, 5400),)),
    )
)


async def test_a_replayed_trace_prints_simulates_table_from_the_gateways_accounting(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(dump_json(TRACE))
    async with GatewayService.serve(
        local_settings(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        shown = await anyio.run_process(
            [sys.executable, "-m", "nbos", "replay", str(path), "--speedup", str(SPEEDUP),
             "--gateway", service.control_address, "--simulate", "--quota", "a=2",
             "--default-quota", "1"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr.decode()
        usage = await call(service.control_address, UsageRequest())
    assert isinstance(usage, Usage)
    out = shown.stdout.decode()
    rows = _table(out)
    assert re.search(r"metric +nbos +replay$", out, re.MULTILINE), (out, shown.stderr.decode())
    assert rows["sessions / cells"] == ["2", "/", "3", "2", "/", "3"]
    assert rows["cells never run"] == ["0", "0"]
    assert rows["hosts mean / max"][-3:] == ["3.0", "/", "3"]

    # The replay column is the gateway's record: every cell got and gave back its GPUs,
    # holding them at least as long as it slept; busy is the trace's work, as simulated.
    # Reserved is the ledger's total: a cell whose executor's claim lost held its GPUs
    # once more than its record (its last attempt's) says.
    assert len(usage.cells) == 3
    assert all(c.started is not None and c.ended is not None for c in usage.cells)
    held = sum(c.gpus * ((c.ended or 0) - (c.started or 0)) for c in usage.cells) * SPEEDUP
    busy = sum(c.duration * (c.gpus or s.gpus) for s in TRACE.sessions for c in s.cells)
    reserved = usage.totals.committed_gpu_s * SPEEDUP
    assert reserved >= held * (1 - 1e-9) and held >= busy
    assert rows["GPU-hours reserved"][-1] == f"{reserved / 3600:,.0f}"
    assert rows["GPU-hours busy"] == [f"{busy / 3600:,.0f}"] * 2

    # Each session is a user of its own; the quotas frame their fair shares in both columns.
    assert "replay: per user (Jain's fairness index" in out
    users = [line.split() for line in out.split("replay: per user")[1].splitlines()[3:5]]
    assert [(u[0], u[1], u[2]) for u in users] == [("a", "2", "2"), ("b", "1", "1")]


def _table(shown: str) -> dict[str, list[str]]:
    """Each row of ``metrics_table`` by its label: labels have single spaces, columns two."""
    return {
        label: values.split()
        for label, _, values in (line.partition("  ") for line in shown.splitlines())
    }


# Four sessions whose 2-GPU cells overlap, on 3 hosts of 2 GPUs: one cell must wait for a
# fourth host. Ten seconds of trace a second of replay: the cells run 20 s, longer than a
# host takes to start on a loaded machine, so the waiting one runs there, not on GPUs freed.
BURST_SPEEDUP = 10.0
BURST = Trace(tuple(Session(f"s{i}", 0, 300, 2, (Cell(20 + 5 * i, 200),)) for i in range(4)))


@pytest.mark.long  # a minute and a half of replay: tests/gateway/test_autoscale.py is the short one
async def test_a_replayed_burst_scales_the_cluster_out_then_back_in(tmp_path: Path) -> None:
    path = tmp_path / "burst.json"
    path.write_bytes(dump_json(BURST))
    settings = autoscaled_settings(tmp_path)
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        shown = await anyio.run_process(
            [sys.executable, "-m", "nbos", "replay", str(path), "--speedup", str(BURST_SPEEDUP),
             "--gateway", service.control_address],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr.decode()
        ledger = service.directory.scheduler.ledger
        # A scale-in counts when it is decided; the host goes once its drain ended (a drain
        # retries a move that a kernel's shutdown cut short).
        await eventually(lambda: ledger.hosts()[-1].hosts == 3, timeout=2 * DEADLINE)
        usage = await call(service.control_address, UsageRequest())
    assert isinstance(usage, Usage)
    assert usage.totals.scale_outs >= 1 and usage.totals.scale_ins >= 1
    assert max(h.hosts for h in usage.hosts) == 4 and usage.hosts[-1].hosts == 3
    # Every cell ran, and one waited for the fourth host: ready before it came, run after.
    assert len(usage.cells) == 4 and all(c.ended is not None for c in usage.cells)
    fourth = min(h.time for h in usage.hosts if h.hosts == 4)
    assert any(c.ready < fourth <= (c.started or 0) for c in usage.cells)
    rows = _table(shown.stdout.decode())
    assert rows["cells never run"] == ["0"]


def test_replay_and_simulate_report_through_the_same_results_code() -> None:
    assert replay.sim_result is simulator.sim_result is results.sim_result
    assert replay.SimResult is simulator.SimResult is results.SimResult
    assert replay_cli.show is simulate_cli.show


def test_a_replays_figures_are_the_gateways_ledger_over_the_run_in_trace_seconds() -> None:
    # One 2-GPU cell submitted a minute into the trace, replayed a minute a second from
    # t0 = 100: it got its GPUs half a second (30 s of trace) late and held them 60 s.
    trace = Trace((Session("a", 0, 120, 2, (Cell(60, 3600),)),))
    before = Usage(0.0, 100.0, [], [HostCount(0.0, 2, 16)], Totals(migrations=1, host_s=200.0))
    after = Usage(
        0.0,
        200.0,
        [CellUsage("k-a", 1, 2, 101.0, 101.5, 161.5)],
        [HostCount(0.0, 2, 16), HostCount(150.0, 3, 24)],
        Totals(migrations=3, host_s=200.0 + 250.0, committed_gpu_s=120.0),
    )
    run = ReplayRun(before, 100.0, after, 200.0, {"a": "k-a"})
    r = replay.result(trace, run, ReplayConfig(speedup=60.0, policy="least-loaded"))
    assert (r.mode, r.delays, r.cells_unserved, r.migrations) == ("replay", (30.0,), 0, 2)
    assert r.hosts_timeline == ((0.0, 2), (3000.0, 3))
    assert (r.hours, r.hosts_mean, r.hosts_max) == (100 * 60 / 3600, 2.5, 3)
    assert r.gpu_hours_reserved == pytest.approx(120 * 60 / 3600)
    assert r.gpu_hours_busy == pytest.approx(2.0)
    assert r.peak_gpus_committed == 2


# Four 2-GPU sessions on 3 hosts of 2 GPUs: the last cell waits for the first to end.
WAIT = Trace(tuple(Session(f"w{i}", 0, 4 * 3600, 2, (Cell(60 + 60 * i, 3600),)) for i in range(4)))


@pytest.mark.long
async def test_a_replay_says_each_wait_on_its_own_line_and_its_progress_in_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(dump_json(WAIT))
    async with GatewayService.serve(
        local_settings(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        shown = await anyio.run_process(
            [sys.executable, "-m", "nbos", "replay", str(path), "--speedup", "1800",
             "--gateway", service.control_address, "--progress-every", "0.5"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )  # fmt: skip
    err = shown.stderr.decode()
    assert shown.returncode == 0, err
    lines = err.splitlines()
    # nbos's line of a waiting cell, said by its kernel: on a line of its own, named.
    waits = [line for line in lines if "wait" in line and not line.startswith("replay: ")]
    assert waits, err
    assert all(re.match(r"session w\d cell 1: ", line) for line in waits), err
    assert all(line.count("nbos") <= 1 for line in lines), err
    # Not a terminal: progress as lines of their own.
    progress = [line for line in lines if line.startswith("replay: ")]
    assert progress and all("trace hours" in line for line in progress), err
    out = shown.stdout.decode()
    assert not any(w.partition(": ")[2] in out for w in waits), out  # stdout: the table only
    # Delays in real seconds too, and the replay's own overhead apart.
    rows = _table(shown.stdout.decode())
    assert len(rows["cell delay p50 / p95 / p99 (real s)"]) == 5
    assert len(rows["replay overhead p50 / p95 / p99 (real s)"]) == 5


def test_a_replays_delays_in_real_seconds_and_its_own_overhead_apart() -> None:
    # Due at t0 + 1 s (a minute of trace, a minute a second); the gateway heard of the
    # cell 0.4 s late (the replay's overhead) and it got its GPUs 0.1 s after that.
    trace = Trace((Session("a", 0, 120, 2, (Cell(60, 3600),)),))
    before = Usage(0.0, 100.0, [], [HostCount(0.0, 2, 16)], Totals())
    after = Usage(
        0.0,
        200.0,
        [CellUsage("k-a", 1, 2, 101.4, 101.5, 161.5)],
        [HostCount(0.0, 2, 16)],
        Totals(committed_gpu_s=120.0),
    )
    run = ReplayRun(before, 100.0, after, 200.0, {"a": "k-a"})
    r = replay.result(trace, run, ReplayConfig(speedup=60.0))
    assert r.delays == pytest.approx((30.0,))
    assert r.real_delays() == pytest.approx((0.5, 0.5, 0.5))
    assert r.overheads == pytest.approx((0.4,))
    table = results.metrics_table([r])
    assert "cell delay p50 / p95 / p99 (real s)" in table and "0.4 / 0.4 / 0.4" in table
    assert "(real s)" not in results.metrics_table([simulator.simulate(trace)])


def test_a_replays_delay_split_scales_the_waits_and_counts_its_own_time_real_at_1x() -> None:
    # A minute of trace a second from t0 = 100. Cell 1 is due at 101 s, sent then, reaches
    # the front 0.1 s later and gets its GPUs 0.4 s after that (nbos's own time: 30 s of
    # trace); cell 2, due at 111 s once cell 1 would have ended, waits behind cell 1 (which
    # ended 0.5 s late) and its reply (0.1 s), then 0.1 s more of nbos's own.
    trace = Trace((Session("a", 0, 1200, 2, (Cell(60, 600), Cell(120, 60))),))
    before = Usage(0.0, 100.0, [], [HostCount(0.0, 2, 16)], Totals())
    cells = [
        CellUsage("k-a", 1, 2, 101.1, 101.5, 111.5, arrived=101.1),
        CellUsage("k-a", 2, 2, 111.65, 111.7, 112.7, arrived=111.65),
    ]
    after = Usage(0.0, 200.0, cells, [HostCount(0.0, 2, 16)], Totals())
    sent = {("a", 1): 101.0, ("a", 2): 111.6}
    run = ReplayRun(before, 100.0, after, 200.0, {"a": "k-a"}, sent=sent)
    r = replay.result(trace, run, ReplayConfig(speedup=60.0))
    assert r.delays == pytest.approx((30.0, 42.0))
    split = r.delay_split
    assert (split.queue, split.overhead) == (pytest.approx(30.0), pytest.approx(42.0))
    assert (split.gpus, split.migration, split.scale_out) == (0.0, 0.0, 0.0)
    # As replayed, no cell started within a second; at 1x nbos's own 0.5 s and the 0.5 s
    # cell 2 waited behind cell 1 (plus its own 0.2 s) would have: both did.
    assert (r.interactive_share, r.interactive_share_1x) == (0.0, 1.0)
    assert "100.0% (1 s)" in results.metrics_table([r])


@given(
    st.lists(
        st.tuples(
            st.integers(1, 4),  # GPUs
            st.floats(0, 50),  # due, trace seconds after t0 ... as real seconds below
            st.floats(0, 5),  # real seconds until it got its GPUs
            st.floats(1, 7200),  # the trace's duration
            st.one_of(st.none(), st.floats(0, 200)),  # real seconds held (None: still)
        ),
        min_size=1,
        max_size=6,
    ),
    st.floats(1, 3600),
)
def test_busy_gpu_hours_never_exceed_reserved(
    cells: list[tuple[int, float, float, float, float | None]], k: float
) -> None:
    # Cells cut short (the run ended while they ran, or they ended early) held their GPUs
    # for less than their duration: busy counts what they held, as reserved does.
    t0, end = 1000.0, 1300.0
    sessions, usages, committed = [], [], 0.0
    for i, (gpus, due, wait, duration, held) in enumerate(cells):
        sessions.append(Session(f"s{i}", 0, 10**6, gpus, (Cell(due * k, duration),)))
        started = t0 + due + wait
        ended = None if held is None else started + held
        committed += gpus * ((ended if ended is not None else end) - started)
        usages.append(CellUsage(f"k{i}", 1, gpus, started, started, ended))
    before = Usage(0.0, t0, [], [HostCount(0.0, 2, 16)], Totals())
    after = Usage(0.0, end, usages, [HostCount(0.0, 2, 16)], Totals(committed_gpu_s=committed))
    run = ReplayRun(before, t0, after, end, {f"s{i}": f"k{i}" for i in range(len(cells))})
    r = replay.result(Trace(tuple(sessions)), run, ReplayConfig(speedup=k))
    assert r.gpu_hours_busy <= r.gpu_hours_reserved * (1 + 1e-9)
    assert r.busy_share <= 1 + 1e-9


def test_a_replay_and_the_simulation_beside_it_count_delays_at_1x_by_one_rule() -> None:
    # A session whose first cell comes as it opens, at 60x: the replay's kernel took 0.5 s
    # to start and the cell 0.02 s more to get its GPUs; the simulation assumes the same
    # durations, each 60 times as long in trace seconds. Neither started within a second of
    # trace; at 1x both did, in both columns of the table.
    trace = Trace((Session("a", 0, 1200, 2, (Cell(0, 600),)),))
    before = Usage(0.0, 100.0, [], [HostCount(0.0, 3, 24)], Totals())
    cells = [CellUsage("k-a", 1, 2, 100.51, 100.52, 110.52, arrived=100.51)]
    after = Usage(0.0, 200.0, cells, [HostCount(0.0, 3, 24)], Totals())
    run = ReplayRun(before, 100.0, after, 200.0, {"a": "k-a"}, sent={("a", 1): 100.5})
    replayed = replay.result(trace, run, ReplayConfig(speedup=60.0))
    timings = Timings(host_startup=10.0, migration_time=2.0, gpu_commit=0.02, kernel_start=0.5)
    config = simulator.SimConfig(hosts=3, autoscaler=None).replaying(timings, 60.0)
    simulated = simulator.simulate(trace, config)
    for r in (replayed, simulated):
        assert 30.0 <= r.delays[0] <= 0.52 * 60 + 1e-9
        assert r.delay_split.overhead == pytest.approx(r.delays[0])
        assert (r.interactive_share, r.interactive_share_1x) == (0.0, 1.0)
    rows = _table(results.metrics_table([simulated, replayed]))
    assert rows["interactive at 1x (start within)"] == ["100.0%", "(1", "s)"] * 2


def test_a_replayed_cell_retried_under_a_new_index_is_still_its_sessions_cell() -> None:
    # Cell 2's first index was lost to an early claim: the gateway's record of it is under
    # index 3, and the session's cells are the kernel's records in order.
    trace = Trace((Session("a", 0, 1200, 1, (Cell(60, 60), Cell(180, 60))),))
    before = Usage(0.0, 100.0, [], [HostCount(0.0, 3, 24)], Totals())
    cells = [
        CellUsage("k-a", 1, 1, 101.0, 101.0, 102.0, arrived=101.0),
        CellUsage("k-a", 3, 1, 103.0, 103.5, 104.5, arrived=103.0),
    ]
    after = Usage(0.0, 200.0, cells, [HostCount(0.0, 3, 24)], Totals(committed_gpu_s=2.0))
    run = ReplayRun(before, 100.0, after, 200.0, {"a": "k-a"})
    r = replay.result(trace, run, ReplayConfig(speedup=60.0))
    assert r.cells_unserved == 0
    assert r.delays == pytest.approx((0.0, 30.0))
