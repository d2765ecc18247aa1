"""A recorded process is found again only while it runs: not once it ended, even as a
zombie its parent has not reaped yet (an orphan's parent, init, reaps it a moment later; a
gateway started in that moment took an agent killed with it for a live one)."""

from __future__ import annotations

import os
import signal
import subprocess

from nbos.agent import ProcessIdentity
from tests.agent._daemons import SLEEPER


def test_a_running_process_is_found_and_a_zombie_is_not() -> None:
    child = subprocess.Popen(SLEEPER)
    try:
        identity = ProcessIdentity.of(child.pid)
        pidfd = identity.open()
        assert pidfd is not None
        os.close(pidfd)
        os.kill(child.pid, signal.SIGKILL)
        # Not reaped: the child stays a zombie until wait(); its pidfd would still open.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        with open(f"/proc/{child.pid}/stat") as stat:
            assert stat.read().rpartition(")")[2].split()[0] == "Z"
        assert identity.open() is None
    finally:
        child.kill()
        child.wait()
    assert identity.open() is None
