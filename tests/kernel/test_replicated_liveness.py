"""Every dead replica is replaced: one that exited, one that stopped answering (stopped
only once its place is taken), one lost while a cell runs; a replacement that failed for
want of a majority is retried; a frozen replica that is not replaced is used again once
it answers.

Real replica processes on a LocalCluster of 4 hosts, real signals (SIGSTOP, SIGKILL).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.kernel.front import HeartbeatPolicy
from tests._servers._process import process_running
from tests._wait import eventually
from tests.cluster.test_gpus import hold_until
from tests.kernel.conftest import connected_client, run_cells
from tests.kernel.test_replicated_failures import reply_to, start_cell
from tests.kernel.test_replicated_replacement import STATE, check_converged, replaced

pytestmark = pytest.mark.anyio

#: A frozen replica is given up on after 3 pings in a row went unanswered for 1.5 s.
HEARTBEAT = HeartbeatPolicy(interval_s=0.5, timeout_s=1.5, misses=3)


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    async with nbos.LocalCluster(
        hosts=4,
        durable=False,
        heartbeat=HEARTBEAT,
        replace_after_s=0.2,
        replace_suspected_after_s=1.0,
    ) as c:
        yield c


def pid_of(kernel: Kernel, node: int) -> int:
    pid = next(r.pid for r in kernel.replicas if r.node == node)
    assert pid is not None
    return pid


@pytest.mark.parametrize("role", ["follower", "executor"])
async def test_a_frozen_replica_is_replaced_and_stopped_once_its_place_is_taken(
    kernel: Kernel, role: str
) -> None:
    executor = await run_cells(kernel, STATE)
    victim = executor if role == "executor" else max(n for n in kernel.front.alive if n != executor)
    pid = pid_of(kernel, victim)
    await kernel.signal_replica(victim, signal.SIGSTOP)  # it does not exit: it stops answering
    new = await replaced(kernel, victim)
    # No longer a member, it is stopped (a thaw cannot bring it back as a member).
    await eventually(lambda: not process_running(pid), timeout=60)
    await check_converged(kernel, new)


async def test_a_replica_lost_while_a_cell_runs_is_replaced_before_the_cell_ends(
    kernel: Kernel, tmp_path: Path
) -> None:
    executor = await run_cells(kernel, STATE)
    first, second = sorted(n for n in kernel.front.alive if n != executor)
    flag = tmp_path / "go"
    async with connected_client(kernel) as client:
        msg_id = await start_cell(client, f"{hold_until(flag)}xs.append(len(xs))")
        await kernel.kill_replica(first)
        new = await replaced(kernel, first)
        assert kernel.front.running_on == executor  # the cell has not ended meanwhile
        # A second failure while the same cell runs: the kernel still has a majority.
        await kernel.kill_replica(second)
        flag.touch()
        reply = await reply_to(client, msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    result = await kernel.execute("print(len(xs))")
    assert (result.status, result.stdout) == ("ok", "5\n"), result.reply
    digests = await kernel.digests()
    assert new in digests and len(set(digests.values())) == 1, digests


async def test_a_kernel_that_lost_its_majority_restarts_its_dead_in_place() -> None:
    # Durable: no replacement can join without a majority, so the dead come back from
    # their own Raft logs on their hosts' disks.
    async with nbos.LocalCluster(hosts=4, durable=True, replace_after_s=0.2) as cluster:
        kernel = await cluster.start_kernel()
        executor = await run_cells(kernel, STATE)
        first, second = sorted(n for n in kernel.front.alive if n != executor)
        await kernel.kill_replica(first)
        await kernel.kill_replica(second)
        await eventually(lambda: {first, second} <= set(kernel.front.alive), timeout=120)
        await check_converged(kernel, first)
        assert kernel.replacement_failures == {}


async def test_a_frozen_replica_not_replaced_is_left_running_and_used_again_once_thawed(
    tmp_path: Path,
) -> None:
    async with nbos.LocalCluster(
        hosts=3, durable=True, heartbeat=HEARTBEAT, replace_dead_replicas=False
    ) as cluster:
        kernel = await cluster.start_kernel()
        executor = await run_cells(kernel, STATE)
        victim = max(n for n in kernel.front.alive if n != executor)
        pid = pid_of(kernel, victim)
        await kernel.signal_replica(victim, signal.SIGSTOP)
        await eventually(lambda: victim not in kernel.front.alive, timeout=60)
        # Missed heartbeats are suspicion: left out, never killed for it.
        await anyio.sleep(2 * HEARTBEAT.timeout_s * HEARTBEAT.misses)
        assert process_running(pid) and kernel.front.unresponsive(victim)
        result = await kernel.execute("len(xs)")  # the kernel goes on with two
        assert result.status == "ok", result.reply
        await kernel.signal_replica(victim, signal.SIGCONT)
        await eventually(lambda: victim in kernel.front.alive, timeout=60)
        await check_converged(kernel, victim)
