"""Migration on the embedded cluster: a cell that no replica's host can serve moves a replica.

4 hosts with 1 virtual GPU each; a kernel has replicas on 3 of them. Another
"kernel" (grants held directly through the scheduler) takes the GPUs of those 3
hosts, so the victim's next GPU cell can run only once a replica moved to the 4th.
"""

from __future__ import annotations

import anyio
import pytest

from nbos.cluster import ExecuteResult
from nbos.core.ids import KernelId
from tests._digests import assert_replicas_agree
from tests._wait import eventually
from tests.cluster.test_gpus import subscribed, virtual_cluster, wait_statuses

pytestmark = pytest.mark.anyio


async def test_a_cell_no_replica_host_can_serve_migrates_a_replica_and_runs_there() -> None:
    async with virtual_cluster(hosts=4, gpus_per_host=1) as c:
        k = await c.start_kernel(gpus=1)
        assert (await k.execute("x = 41")).status == "ok"
        before = {r.node: r.host for r in k.replicas}
        (free,) = set(c.gpus.agents) - set(before.values())
        scheduler = c.gpus.scheduler
        hog = KernelId("test-hog")
        hogs = [
            await scheduler.acquire(hog, i, {1: h}, last_executor=None, gpus=1)
            for i, h in enumerate(sorted(before.values()))
        ]
        result = await k.execute("x += 1\nprint(x)", timeout=120)
        for grant in hogs:
            await scheduler.release(grant)
        assert (result.status, result.stdout) == ("ok", "42\n")
        assert any("waits for a migration" in text for _, text in wait_statuses(result.outputs))
        live = {r.node: r.host for r in k.replicas if r.alive}
        assert len(live) == 3 and free in live.values()
        assert result.executor is not None and live[result.executor] == free
        (moved,) = set(before) - set(live)  # exactly one replica left its host
        assert before[moved] not in live.values()
        await assert_replicas_agree(k)
        await k.shutdown()
        await eventually(lambda: c.gpus.idle() and subscribed(c) == [0, 0, 0, 0])


async def test_no_migration_while_a_replica_is_dead_the_cell_waits_instead() -> None:
    # Moving one of 2 live replicas would leave the kernel without a quorum meanwhile.
    async with virtual_cluster(hosts=4, gpus_per_host=1) as c:
        k = await c.start_kernel(gpus=1)
        assert (await k.execute("x = 41")).status == "ok"
        dead = k.replicas[0].node
        await k.kill_replica(dead)
        before = {r.node: r.host for r in k.replicas if r.alive}
        scheduler = c.gpus.scheduler
        hog = KernelId("test-hog")
        hogs = [
            await scheduler.acquire(hog, i, {1: h}, last_executor=None, gpus=1)
            for i, h in enumerate(sorted(before.values()))
        ]
        results: list[ExecuteResult] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                results.append(await k.execute("x += 1\nprint(x)", timeout=60))

            tg.start_soon(run)
            await eventually(lambda: any(key[0] == k.kernel_id for key in scheduler.waiting()))
            await anyio.sleep(0.5)  # time enough for a migration to start, were it allowed
            assert {r.node: r.host for r in k.replicas if r.alive} == before
            for grant in hogs:
                await scheduler.release(grant)
        (result,) = results
        assert (result.status, result.stdout) == ("ok", "42\n")
        assert result.executor in before
        assert not any("migration" in text for _, text in wait_statuses(result.outputs))
        await k.shutdown()
        await eventually(lambda: c.gpus.idle() and subscribed(c) == [0, 0, 0, 0])
