"""The nbos command, run as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys

import nbos


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbos", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"nbos {nbos.__version__}"


def test_help_lists_options() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "--config" in result.stdout


def test_unknown_option_fails_cleanly() -> None:
    result = run_cli("--no-such-option")
    assert result.returncode == 2
    assert "unrecognized arguments" in result.stderr
    assert "Traceback" not in result.stderr
