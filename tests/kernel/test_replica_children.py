"""A replica knows in one call whether it has a child process (ipykernel's shutdown reads
every process on the host to find them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# In a fresh interpreter: the test's own process may have children of other tests.
PROBE = """
import os, subprocess, sys
from nbos.kernel.replica._kernel import has_child_processes
seen = [has_child_processes()]
child = subprocess.Popen(['sleep', '60'])
seen.append(has_child_processes())
child.kill()
os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
seen.append(has_child_processes())
seen.append(child.wait() == -9)  # the probe reaped nothing: its status is still there
seen.append(has_child_processes())
print(seen)
"""


def test_a_child_running_or_not_yet_reaped_counts_and_none_is_seen_without_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split("\n")[-2] == "[False, True, True, True, False]"
