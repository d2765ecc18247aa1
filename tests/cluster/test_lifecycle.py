"""Leaving a LocalCluster while its task is being cancelled ends everything it started.

A test's timeout, Ctrl-C mid-cell, ``anyio.move_on_after`` around the cluster: the
teardown must return promptly and leave no replica process behind.
"""

from __future__ import annotations

import anyio
import pytest

import nbos
from nbos.cluster import Kernel
from tests._servers._process import process_running
from tests._wait import eventually

pytestmark = pytest.mark.anyio

#: Generous: the teardown itself needs a few seconds; a hang would never return.
TEARDOWN_WITHIN_S = 30.0


async def cell_running(kernel: Kernel) -> None:
    await eventually(lambda: kernel.front.running_on is not None, timeout=60)


@pytest.mark.parametrize("replace", [True, False])
async def test_cancelling_a_cluster_mid_cell_ends_its_processes_promptly(replace: bool) -> None:
    pids: list[int] = []
    cancelled_at = 0.0
    with anyio.fail_after(90) as bound:  # start-up; tightened below to time the teardown
        with anyio.CancelScope() as scope:
            async with nbos.LocalCluster(hosts=3, replace_dead_replicas=replace) as cluster:
                kernel = await cluster.start_kernel()
                pids = [r.pid for r in kernel.replicas if r.pid is not None]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kernel.execute, "import time\ntime.sleep(600)")
                    await cell_running(kernel)
                    # The deadline passes mid-cell: the block is left by cancellation.
                    cancelled_at = anyio.current_time()
                    scope.deadline = cancelled_at + 0.2
                    bound.deadline = cancelled_at + TEARDOWN_WITHIN_S
                    await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert len(pids) == 3
    assert [p for p in pids if process_running(p)] == [], "replica processes outlived the cluster"
