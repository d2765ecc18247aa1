"""The provisioner under a real KernelManager: alive while a quorum of replicas lives."""

from __future__ import annotations

import os
import signal

import pytest
from jupyter_client.manager import KernelManager

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

        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: len(replica_pids(km)) == 2, timeout=20)
        assert km.is_alive(), "two of three replicas are a quorum"
        reply = client.execute_interactive("print('still here')", timeout=60)
        assert reply["content"]["status"] == "ok"

        # The first one may have been replaced by now (the gateway replaces dead
        # replicas): two of the live ones at once leave no majority to replace them.
        live = replica_pids(km)
        for pid in live[: len(live) - 1]:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not km.is_alive(), timeout=20), "one of three is no quorum"
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
