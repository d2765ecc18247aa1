"""The simulator's timings file: what ``nbos calibrate`` writes and ``simulate`` reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.cli.main import main
from nbos.core.errors import ConfigError
from nbos.scaling import Cell, Session, SimConfig, Trace, simulate
from nbos.scaling.timings import MEASURED, Timings, load_timings
from nbos.scaling.trace import dump_json

SLOW = Timings(host_startup=30.0, migration_time=12.5, gpu_commit=0.5, kernel_start=20.0)


def test_timings_written_are_read_back_and_taken_by_the_simulator(tmp_path: Path) -> None:
    path = tmp_path / "timings.toml"
    path.write_text(SLOW.as_toml("measured here\nmedians of 3"))
    assert load_timings(path) == SLOW
    # One cell at 5 s on a kernel placed at 0: it waits for the kernel's start (20 s) and
    # its GPU commit (0.5 s), as on the live cluster.
    trace = Trace((Session("a", 0, 100, 1, (Cell(5, 10),)),))
    config = SimConfig(hosts=3, gpus_per_host=1, autoscaler=None).timed(load_timings(path))
    assert simulate(trace, config).delays == (pytest.approx(20.5 - 5),)


def test_the_defaults_are_this_machines_figures() -> None:
    config = SimConfig()
    assert (config.host_startup, config.migration_time) == (
        MEASURED.host_startup,
        MEASURED.migration_time,
    )
    assert (config.gpu_commit, config.kernel_start) == (MEASURED.gpu_commit, MEASURED.kernel_start)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("host_startup = 1\nmigration_time = 1\ngpu_commit = 1\nkernel_start = 1\ntick = 5\n",
         "tick"),
        ("host_startup = 1\nmigration_time = 1\ngpu_commit = 1\n", "kernel_start"),
        ("host_startup = -1\nmigration_time = 1\ngpu_commit = 1\nkernel_start = 1\n",
         "host_startup"),
        ('host_startup = 1\nmigration_time = "fast"\ngpu_commit = 1\nkernel_start = 1\n',
         "migration_time"),
        ("host_startup = 1\nmigration_time = nan\ngpu_commit = 1\nkernel_start = 1\n",
         "migration_time"),
        ("host_startup = 1\nmigration_time = 1\ngpu_commit = true\nkernel_start = 1\n",
         "gpu_commit"),
        ("host_startup = [1\n", ""),
    ],
)  # fmt: skip
def test_a_bad_timings_file_is_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_timings(path)
    assert key in caught.value.key or key in str(caught.value)


def test_simulate_refuses_a_bad_timings_file_and_takes_a_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "t.json").write_bytes(dump_json(Trace((Session("a", 0, 100, 1, (Cell(5, 10),)),))))
    (tmp_path / "bad.toml").write_text("migration = 3\n")
    (tmp_path / "good.toml").write_text(SLOW.as_toml())
    argv = ["simulate", "--trace", str(tmp_path / "t.json"), "--mode", "nbos", "--json"]
    assert main([*argv, "--timings", str(tmp_path / "bad.toml")]) == 1
    assert "migration" in capsys.readouterr().err
    assert main([*argv, "--timings", str(tmp_path / "good.toml")]) == 0
    assert '"delay_p50": 15.5' in capsys.readouterr().out
