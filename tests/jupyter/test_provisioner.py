"""The provisioner under a real KernelManager: alive while a quorum of replicas lives."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from jupyter_client.manager import KernelManager


def replica_pids(host_pid: int) -> list[int]:
    """The replica processes the kernel host started (its direct children)."""
    children = Path(f"/proc/{host_pid}/task/{host_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def wait_until(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_poll_reports_alive_while_a_quorum_lives() -> None:
    km = KernelManager(kernel_name="nbos")
    km.start_kernel()
    try:
        assert km.provisioner is not None
        assert type(km.provisioner).__name__ == "NbosProvisioner"
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        host_pid = km.provisioner.pid
        pids = replica_pids(host_pid)
        assert len(pids) == 3

        os.kill(pids[0], signal.SIGKILL)
        time.sleep(2.0)
        assert km.is_alive(), "two of three replicas are a quorum"
        reply = client.execute_interactive("print('still here')", timeout=60)
        assert reply["content"]["status"] == "ok"

        # The first one may have been replaced by now (LocalCluster replaces dead
        # replicas): two of the live ones at once leave no majority to replace them.
        live = replica_pids(host_pid)
        for pid in live[: len(live) - 1]:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not km.is_alive(), timeout=20), "one of three is no quorum"
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
