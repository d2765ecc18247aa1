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


# What a command loads: ``nbos agent`` (one per host, for good) must not carry the
# gateway's, chaos's or Jupyter's modules.
IMPORTS_OF_A_COMMAND = """
import sys
from nbos.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
import nbos.agent
print(" ".join(sys.modules))
"""


def modules_after(*args: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_OF_A_COMMAND, *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return set(result.stdout.split())


def test_a_command_imports_only_its_own_code() -> None:
    for args in (["agent", "--help"], ["--log-level", "INFO", "agent", "--help"]):
        loaded = modules_after(*args)
        heavy = {
            m for m in loaded if m.startswith(("nbos.gateway", "nbos.chaos", "jupyter_client"))
        }
        assert not heavy, (args, sorted(heavy))
    # Help with no command, and arguments that do not parse, still know every command.
    assert "nbos.cli.chaos" in modules_after("--help")
    assert "nbos.cli.chaos" in modules_after("--log-level", "LOUD", "agent")
