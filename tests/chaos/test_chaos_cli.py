"""``nbos chaos`` as a user runs it: a real process on a real embedded cluster."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from nbos.chaos import FaultReport, PlannedFault, Strike
from nbos.cli import chaos as chaos_cli


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbos", "--log-level", "ERROR", "chaos", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_a_short_run_ends_with_a_table_and_exits_0() -> None:
    result = run_cli(
        "--duration", "3", "--seed", "3", "--nemesis", "kill-follower", timeout=240
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["#", "fault", "target", "detected", "recovered", "lost",
                                "violations"]  # fmt: skip
    assert lines[2].split()[:2] == ["1", "kill-follower"]
    assert lines[-1].startswith("seed 3: ") and lines[-1].endswith(" 0 violations")
    assert "fault 1:" in result.stderr  # progress
    assert "Traceback" not in result.stderr


def test_a_nemesis_that_needs_a_gateway_is_refused() -> None:
    result = run_cli("--nemesis", "kill-follower", "--nemesis", "kill-gateway", timeout=60)
    assert result.returncode == 1
    assert "nemesis 'kill-gateway' needs gateway" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--nemesis", "freeze-gateway"], "needs local-gateway, which the gateway at"),
        (["--nemesis", "cpu-hog"], "needs local-gateway, which the gateway at"),
        (["--nemesis", "fill-disk"], "needs gateway-data-dir, which the gateway at"),
        (["--bystanders", "-1"], "'--bystanders': -1"),
    ],
)
def test_a_control_plane_nemesis_without_what_it_needs_is_refused(
    argv: list[str], said: str
) -> None:
    # Nothing listens on port 9 of this machine: no gateway process to stop or load.
    result = run_cli("--gateway", "127.0.0.1:9", *argv, timeout=60)
    assert result.returncode == 1, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr


def test_a_data_dir_needs_a_gateway() -> None:
    result = run_cli("--data-dir", "/tmp", "--nemesis", "kill-follower", timeout=60)
    assert result.returncode == 1 and "'--data-dir'" in result.stderr, result.stderr


def test_an_unknown_nemesis_is_a_usage_error() -> None:
    result = run_cli("--nemesis", "kill-everything", timeout=60)
    assert result.returncode == 2 and "invalid choice" in result.stderr


FAULT = PlannedFault(1, "kill-follower", 2, 0.5, 42)
DONE = FaultReport(1, "kill-follower", "replica 3", True, 1.25, 0, ())


def test_progress_off_a_terminal_is_one_line_per_fault_event() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), chaos_cli._progress(10.0) as observer:
        observer.fault_started(FAULT, Strike("replica 3", (3,)))
        observer.fault_done(DONE)
    assert err.getvalue().splitlines() == [
        "fault 1: kill-follower replica 3",
        "fault 1: recovered in 1.2 s, 0 cells lost, 0 violations",
    ]


def test_progress_on_a_terminal_is_a_bar_naming_each_fault() -> None:
    primary, secondary = pty.openpty()
    # A terminal has a size; tqdm draws nothing on a 0-column one.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    try:
        with (
            os.fdopen(secondary, "w") as terminal,
            contextlib.redirect_stderr(terminal),
            chaos_cli._progress(10.0) as observer,
        ):
            observer.fault_started(FAULT, Strike("replica 3", (3,)))
            observer.fault_done(DONE)
        shown = _read_all(primary)
    finally:
        os.close(primary)
    assert "fault 1: kill-follower replica 3" in shown  # the bar's description
    assert "fault 1: kill-follower: recovered in 1.2 s" in shown
    assert "%|" in shown  # a bar, not plain lines


def _read_all(primary: int) -> str:
    """All a closed terminal showed. The kernel hands what was written on to the reading
    side in the background: one read may get only the first write (it did, on a loaded
    machine). Reading ends with EIO once the closed side has nothing more."""
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
