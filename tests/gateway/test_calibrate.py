"""``nbos calibrate``: the durations of nbos's own work measured on an embedded live gateway,
written as the timings file the simulator takes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

from nbos.scaling import Cell, Session, SimConfig, Trace, simulate
from nbos.scaling.timings import load_timings
from tests.agent._daemons import ROOT

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


async def test_calibrate_writes_timings_the_simulator_takes(tmp_path: Path) -> None:
    out = tmp_path / "timings.toml"
    done = await anyio.run_process(
        [sys.executable, "-m", "nbos", "calibrate", "--samples", "1", "--out", str(out)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err
    # A line per sample as it is taken, for each duration.
    for what in ("kernel start", "GPU commit", "migration", "host start"):
        assert f"calibrate: {what} 1 of 1: " in err
    timings = load_timings(out)
    assert done.stdout.decode() == out.read_text()
    # Every duration took some time; a kernel's start is replicas started and elected.
    assert 0 < timings.gpu_commit < timings.kernel_start
    assert timings.migration_time > 0 and timings.host_startup > 0
    trace = Trace((Session("a", 0, 3600, 1, (Cell(0, 60),)),))
    config = SimConfig(hosts=3, autoscaler=None).timed(timings)
    # The cell, due at the session's start, waits for the kernel's start and its commit.
    (delay,) = simulate(trace, config).delays
    assert delay == pytest.approx(timings.kernel_start + timings.gpu_commit)


async def test_calibrate_refuses_no_samples_before_starting_anything(tmp_path: Path) -> None:
    done = await anyio.run_process(
        [sys.executable, "-m", "nbos", "calibrate", "--samples", "0", "--out", "t.toml"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 1
    assert "--samples" in done.stderr.decode()
    assert not (tmp_path / "t.toml").exists()
