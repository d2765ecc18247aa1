"""The provisioner under a real KernelManager: alive while a quorum of replicas lives or
can come back from its disks, dead once it cannot."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from tests.gateway._service import wipe_raft_dirs
from tests.jupyter._gateway import replica_pids, wait_until

# The first kernel of a session may start the per-user gateway, its agents cold.
pytestmark = pytest.mark.timeout(300)


def test_poll_reports_alive_while_a_quorum_lives() -> None:
    km = KernelManager(kernel_name="nbos")
    km.start_kernel()
    try:
        assert km.provisioner is not None
        assert type(km.provisioner).__name__ == "NbosProvisioner"
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        pids = replica_pids(km)
        assert len(pids) == 3

        reply = client.execute_interactive("x = 'kept'", timeout=60)
        assert reply["content"]["status"] == "ok"
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: len(replica_pids(km)) == 2, timeout=20)
        assert km.is_alive(), "two of three replicas are a quorum"
        reply = client.execute_interactive("print('still here')", timeout=60)
        assert reply["content"]["status"] == "ok"

        # Two at once leave no majority: the kernel restarts them in place from their
        # disks, alive for Jupyter all along (a poll saying dead would have Jupyter's
        # restarter start an empty kernel), and its namespace is whole.
        live = replica_pids(km)
        for pid in live[: len(live) - 1]:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: len(replica_pids(km)) == 3, timeout=120)
        assert km.is_alive()
        outputs: list[str] = []

        def hook(message: dict[str, Any]) -> None:
            outputs.append(message["content"].get("text", ""))

        reply = client.execute_interactive("print(x)", timeout=60, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        assert "".join(outputs) == "kept\n"

        # With the disks of all three gone, nothing can bring them back: dead for Jupyter.
        live = replica_pids(km)
        wipe_raft_dirs(live)
        for pid in live:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not km.is_alive(), timeout=120), "a lost kernel is dead"
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
