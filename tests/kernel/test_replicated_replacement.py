"""A dead replica is replaced by a new Raft member on another host; the kernel has 3 again.

Real replica processes on a LocalCluster of 4 hosts (so the replacement can avoid the
dead replica's host too). Snapshots every few entries and a namespace image after
every cell, so a replacement catches up from a snapshot plus the log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.core.config import RaftSettings, Settings
from nbos.core.errors import KernelError
from tests._digests import assert_replicas_agree
from tests.kernel.conftest import run_cells

pytestmark = pytest.mark.anyio

STATE = [
    "import numpy as np\nxs = [1, 2, 3]\nalias = xs\nbig = np.arange(100_000)",
    "def total():\n    return sum(xs) + int(big.sum())",
    "xs.append(4)",
]
REPLACED_WITHIN_S = 45.0


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    # A cluster per test: a replacement still settling from one test must not meet the next.
    settings = Settings(raft=RaftSettings(snapshot_every=4))
    async with nbos.LocalCluster(
        hosts=4, durable=False, settings=settings, rebase_bytes=1, replace_after_s=0.2
    ) as c:
        yield c


async def replaced(kernel: Kernel, dead: int) -> int:
    """Wait until ``dead`` was replaced and 3 replicas are live again; the new node id."""
    with anyio.fail_after(REPLACED_WITHIN_S):
        while True:
            live = {r.node for r in kernel.replicas if r.alive}
            if dead not in {r.node for r in kernel.replicas} and len(live) == 3:
                return max(live)  # node ids only grow: the newest member
            await anyio.sleep(0.1)


async def check_converged(kernel: Kernel, new: int) -> None:
    """A cell after the replacement; every live replica, the new one too, has its state."""
    result = await kernel.execute("xs.append(len(xs))\nprint(total())")
    assert result.status == "ok", result.reply
    assert result.stdout == f"{sum(range(1, 5)) + 4 + 99_999 * 100_000 // 2}\n"
    digests = await kernel.digests()
    assert set(digests) == {r.node for r in kernel.replicas} and new in digests
    assert len(set(digests.values())) == 1, digests


async def test_a_dead_non_executor_is_replaced_and_the_new_membership_carries_on(
    kernel: Kernel,
) -> None:
    executor = await run_cells(kernel, STATE)
    originals = {r.node: r.host for r in kernel.replicas}
    victim = next(n for n in originals if n != executor)
    await kernel.kill_replica(victim)
    new = await replaced(kernel, victim)
    hosts = {r.node: r.host for r in kernel.replicas}
    assert new not in originals
    assert hosts[new] not in {h for n, h in hosts.items() if n != new}
    assert hosts[new] != originals[victim]  # 4 hosts: the dead one's is avoided
    await check_converged(kernel, new)
    # The originals go one at a time: each replacement needs a quorum that includes the
    # replacements before it, so they are voters of the new membership.
    for original in sorted(set(originals) - {victim}):
        await kernel.kill_replica(original)
        await replaced(kernel, original)
    assert not set(originals) & {r.node for r in kernel.replicas}
    result = await kernel.execute("print(len(alias), total())")
    assert result.status == "ok", result.reply
    assert result.executor not in originals
    assert result.stdout.split()[0] == "5"
    await assert_replicas_agree(kernel)


async def test_a_dead_executor_is_replaced(kernel: Kernel) -> None:
    executor = await run_cells(kernel, STATE)
    await kernel.kill_replica(executor)
    new = await replaced(kernel, executor)
    await check_converged(kernel, new)
    # The new replica runs cells: it is the only one left besides one original.
    others = [r.node for r in kernel.replicas if r.node != new]
    await kernel.kill_replica(others[0])
    result = await kernel.execute("print(len(xs))")
    assert result.stdout == "5\n", result.reply


async def test_replace_replica_on_demand(kernel: Kernel) -> None:
    executor = await run_cells(kernel, STATE)
    for bad in ({"op": "add_learner", "node": 9}, {"op": "promote", "node": -1}, {"op": "x"}):
        reply = await kernel.front.control_request(executor, "nbos_member_request", bad, timeout=10)
        assert reply is not None and reply["content"]["ename"] == "ValidationError", bad
    victim = next(r.node for r in kernel.replicas if r.node != executor)
    new = await kernel.replace_replica(victim)  # it still runs: it is killed first
    assert victim not in {r.node for r in kernel.replicas}
    assert {r.node for r in kernel.replicas if r.alive} == {*kernel.front.alive}
    assert new in kernel.front.alive and len(kernel.front.alive) == 3
    await check_converged(kernel, new)
    with pytest.raises(KernelError):
        await kernel.replace_replica(victim)  # gone for good


async def test_a_durable_kernel_restarts_a_replica_in_place_after_a_replacement() -> None:
    # A long grace: the restart in place comes first, and the policy then leaves it be.
    async with nbos.LocalCluster(hosts=3, durable=True, replace_after_s=30.0) as cluster:
        kernel = await cluster.start_kernel()
        executor = await run_cells(kernel, STATE)
        victim, other = sorted(r.node for r in kernel.replicas if r.node != executor)
        new = await kernel.replace_replica(victim)
        await kernel.kill_replica(other)
        await kernel.restart_replica(other)  # from its own log, which has the new member
        assert set(kernel.front.alive) == {executor, other, new}
        await check_converged(kernel, new)
        # Without the old executor, the restarted replica and the new one are a majority.
        await kernel.kill_replica(executor)
        result = await kernel.execute("print(len(xs))")
        assert result.stdout == "5\n", result.reply
        assert result.executor in {other, new}
