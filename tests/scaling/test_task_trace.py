"""The task-level trace importer, the month trace (bounded), the overrun limit, the host
ceiling warning, the progress bar and the plot of ``nbos simulate``."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from nbos.cli.main import main
from nbos.core.errors import ScalingError
from nbos.scaling import (
    AutoscalerConfig,
    Cell,
    Session,
    SimConfig,
    Trace,
    first_hours,
    load_trace,
    simulate,
)
from nbos.scaling.trace import parse_task_csv

TRACE = Path("shared") / "traces" / "adobe_june_tasks.csv"
# shared/ sits beside the checkout (or beside its worktrees' folder).
MONTH = next(
    (p / TRACE for p in Path(__file__).resolve().parents if (p / TRACE).exists()),
    TRACE,
)
needs_month = pytest.mark.skipif(not MONTH.exists(), reason="no shared/traces here")

TASKS = """job_id,num_gpu,submit_time,iterations,model_name,duration,interval
0,1,10,0,resnet50,5,0
1,4,12,0,vgg11,3,0
2,1,12,0,vgg11,1,0
3,8,2,0,bert,60,0
4,1,100,0,bert,2,0
"""


def test_a_new_session_begins_where_submit_time_goes_backwards() -> None:
    trace = parse_task_csv(TASKS)
    a, b = trace.sessions
    # Minutes become seconds; a session holds its largest task's GPUs from its first
    # submission until its last task ends as the trace ran it.
    assert (a.start, a.stop, a.gpus) == (600.0, (12 + 3) * 60.0, 4)
    assert [(c.start, c.duration, c.gpus) for c in a.cells] == [
        (600.0, 300.0, 1),
        (720.0, 180.0, 4),
        (720.0, 60.0, 1),
    ]
    assert (b.start, b.stop, b.gpus, len(b.cells)) == (120.0, (100 + 2) * 60.0, 8, 2)


def test_load_trace_tells_the_task_form_by_its_header(tmp_path: Path) -> None:
    (tmp_path / "tasks.csv").write_text(TASKS)
    assert load_trace(tmp_path / "tasks.csv") == parse_task_csv(TASKS)
    (tmp_path / "bad.csv").write_text(TASKS.replace("\n2,1,12", "\n2,one,12"))
    with pytest.raises(ScalingError, match="line 4: num_gpu 'one' is not an integer"):
        load_trace(tmp_path / "bad.csv")


@needs_month
def test_the_month_trace_imports_as_337_sessions_of_30909_cells() -> None:
    trace = load_trace(MONTH)
    assert (len(trace.sessions), sum(len(s.cells) for s in trace.sessions)) == (337, 30909)
    assert trace.end / 3600 == pytest.approx(719.8, abs=0.1)
    # The session rule's reservation baseline: about a quarter busy, as the paper found.
    assert 0.24 < trace.gpu_hours_busy() / trace.gpu_hours_reserved() < 0.26


@needs_month
@pytest.mark.parametrize("mode", ["nbos", "reservation"])
def test_the_first_three_days_of_the_month_trace_run_to_the_end(mode: str) -> None:
    trace = first_hours(load_trace(MONTH), 72)
    result = simulate(trace, SimConfig(mode=mode))  # type: ignore[arg-type]
    cells = sum(len(s.cells) for s in trace.sessions)
    assert (result.sessions, result.cells) == (len(trace.sessions), cells)
    assert len(result.delays) + result.cells_unserved == cells
    assert result.gpu_hours_reserved >= result.gpu_hours_busy - 1e-6
    if mode == "nbos":
        assert result.cells_unserved == 0
        assert result.gpu_hours_busy == pytest.approx(trace.gpu_hours_busy())
    else:
        # 64 hosts hold too few GPUs for every session's reservation.
        assert result.hosts_max == 64 and result.hours_at_ceiling > 0


def one_gpu_hog() -> Trace:
    """On one 1-GPU host a holds the GPU for 10,000 s; b's session (0-200 s) must wait."""
    return Trace(
        (Session("a", 0, 100, 1, (Cell(5, 10_000),)), Session("b", 0, 200, 1, (Cell(10, 5),)))
    )


def test_work_still_waiting_at_the_overrun_limit_is_never_run() -> None:
    config = SimConfig(hosts=1, gpus_per_host=1, mode="reservation", autoscaler=None,
                       overrun_limit=600.0)  # fmt: skip
    r = simulate(one_gpu_hog(), config)
    # b is still waiting at 200 + 600 s: it never runs, though a frees the GPU at 10,005 s.
    assert (r.cells, r.cells_unserved, len(r.delays)) == (2, 1, 1)
    assert r.hours * 3600 == pytest.approx(10_005)  # a's running cell still finishes
    assert r.gpu_hours_reserved == pytest.approx(10_005 / 3600)


def test_waiting_at_the_host_ceiling_is_warned_and_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = SimConfig(hosts=1, gpus_per_host=1, mode="reservation",
                       autoscaler=AutoscalerConfig(min_hosts=1, max_hosts=1))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="nbos.scaling.simulator"):
        r = simulate(one_gpu_hog(), config)
    assert any("ceiling of 1 hosts" in m for m in caplog.messages)
    assert r.hours_at_ceiling > 0
    assert r.cells_unserved == 0  # the default overrun limit (6 h) outlasts a's cell


def test_the_cli_reads_a_task_trace_and_plots_both_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tasks.csv").write_text(TASKS)
    out = tmp_path / "out.png"
    assert main(["simulate", str(tmp_path / "tasks.csv"), "--plot", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "nbos", "reservation"]
    assert any(line.split()[:3] == ["sessions", "/", "cells"] for line in lines)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_progress_bar_is_shown_on_a_terminal_only(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "nbos", "simulate", "--synthetic", "3", "--hours", "30",
            "--mode", "nbos"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    primary, secondary = pty.openpty()
    # A terminal has a size; tqdm draws nothing on a 0-column one.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=secondary, env=env,
                              timeout=120, check=True)  # fmt: skip
        os.close(secondary)
        shown = _read_all(primary)
    finally:
        os.close(primary)
    assert "simulating nbos" in shown
    assert proc.stdout.decode().splitlines()[0].split() == ["metric", "nbos"]
    piped = subprocess.run(argv, capture_output=True, env=env, timeout=120, check=True)
    assert "simulating" not in piped.stderr.decode()


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
