"""Recovery: a majority lost mid-cell, a restarted executor, a cell declared lost while
its executor was frozen, a restart while a heartbeat waits. Real replica processes, real
SIGKILL / SIGSTOP.

Each test gets a kernel of its own on one shared durable cluster (restarts need the
replicas' Raft logs on disk); the heartbeat test has a cluster of its own.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.kernel.front import CellPlan, ChoiceRequest, HeartbeatPolicy
from tests._digests import assert_replicas_agree
from tests._wait import eventually
from tests.kernel.conftest import (
    connected_client,
    reply_to,
    run_cells,
    start_cell,
)

pytestmark = pytest.mark.anyio

# A counter and an append-only list: a cell that counts shows in both or in neither.
CELLS = ["import os, time\nn = 0\nL = []", *["n += 1\nL.append(n)"] * 3]
AFTER = "3 [1, 2, 3]\n"  # print(n, L) after CELLS


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    # Heartbeats fast enough to notice a frozen replica in a few seconds, slow enough
    # that a busy machine does not drop a live one. No replacements: these tests are
    # about restarts (tests/kernel/test_replicated_replacement.py has replacements). A
    # frozen replica stays alive (nothing is killed on suspicion) to show what it does
    # once thawed.
    heartbeat = HeartbeatPolicy(interval_s=0.25, timeout_s=1.0, misses=3)
    async with nbos.LocalCluster(
        hosts=3,
        durable=True,
        heartbeat=heartbeat,
        replace_dead_replicas=False,
        run_dir=tmp_path_factory.mktemp("cluster"),  # kept: the replicas' logs
    ) as c:
        yield c


async def assert_recovered(kernel: Kernel, expected: str, *, replicas: int = 3) -> None:
    """The kernel serves a cell again, its state is ``expected``, its ``replicas`` live
    replicas agree."""
    result = await kernel.execute("print(n, L)", timeout=120)
    assert result.status == "ok", result.reply
    assert result.stdout == expected
    await assert_replicas_agree(kernel, replicas, timeout=60)


async def test_a_majority_lost_with_the_executor_mid_cell_fails_at_once_and_recovers(
    kernel: Kernel,
) -> None:
    executor = await run_cells(kernel, CELLS)
    other = next(r.node for r in kernel.replicas if r.node != executor)
    async with connected_client(kernel) as client:
        msg_id = await start_cell(client, "n += 1\nL.append(99)\ntime.sleep(60)")
        await kernel.kill_replica(executor)
        await kernel.kill_replica(other)
        # At once: not after a commit timeout (30 s) of the survivor's settle.
        reply = await reply_to(client, msg_id, timeout=20)
    assert reply["content"]["ename"] == "QuorumLostError", reply["content"]
    # The cell in flight has no outcome yet (QuorumLostError); a cell sent now is refused
    # before it goes anywhere: nothing restarts the replicas until the test does.
    with anyio.fail_after(20):
        refused = await kernel.execute("print(n)")
    assert refused.error is not None and refused.error[0] == "KernelDeadError"
    for node in (executor, other):
        await kernel.restart_replica(node)
    # The cell's executor died before its Done: it is settled as lost, and nothing of it
    # is kept. The restarted executor replays its own cells from its log.
    await assert_recovered(kernel, AFTER)


async def test_a_majority_lost_around_the_running_executor_rolls_its_cell_back(
    kernel: Kernel, tmp_path: Path
) -> None:
    executor = await run_cells(kernel, CELLS)
    others = [r.node for r in kernel.replicas if r.node != executor]
    go = tmp_path / "go"
    async with connected_client(kernel) as client:
        msg_id = await start_cell(
            client,
            f"n += 1\nL.append(99)\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)",
        )
        lost = kernel.front.last_exec_index
        for node in others:
            await kernel.kill_replica(node)
        reply = await reply_to(client, msg_id, timeout=20)
    assert reply["content"]["ename"] == "QuorumLostError", reply["content"]
    for node in others:
        await kernel.restart_replica(node)
    # With a majority back, the front settles the cell (as lost: its executor still runs
    # it, so no Done of its own could commit first). The restarted replicas apply that.
    for node in others:
        reply_msg = await kernel.front.control_request(
            node, "nbos_digest_request", {"after": lost}, timeout=90
        )
        assert reply_msg is not None and reply_msg["content"]["status"] == "ok"
    go.touch()  # the executor's cell ends; its Done is refused and it rolls back
    await assert_recovered(kernel, AFTER)


@attrs.define
class Preferring:
    """An ``ExecutorChooser`` that runs cells on ``node`` while it is alive."""

    node: int | None = None

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        if self.node in request.alive:
            return CellPlan(self.node)
        if request.last_executor in request.alive:
            return CellPlan(request.last_executor)
        return CellPlan(min(request.alive))

    async def release(self, plan: CellPlan) -> None:
        return None


async def test_a_restarted_executor_replays_the_cells_it_ran_itself(cluster: LocalCluster) -> None:
    chooser = Preferring()
    kernel = await cluster.start_kernel(chooser=chooser)
    try:
        cells = ["a = 'A'", "def f():\n    return 'F'", "n = 0", "n += 1"]
        executor = await run_cells(kernel, cells)
        await kernel.kill_replica(executor)
        await kernel.restart_replica(executor)
        chooser.node = executor
        result = await kernel.execute("print(a, f(), n)")
        assert result.executor == executor
        assert (result.status, result.stdout) == ("ok", "A F 1\n"), result.reply
        await assert_replicas_agree(kernel)
    finally:
        await kernel.shutdown()


def unread_bytes(port: int) -> int:
    """Bytes received and not read yet on the established TCP connections to local ``port``."""
    unread = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
            unread += int(queues.split(":")[1], 16)
    return unread


async def test_a_replica_restarted_while_a_ping_awaits_its_echo_comes_back(
    tmp_path: Path,
) -> None:
    """A restart does not take the front down when it comes while a heartbeat ping to the
    killed replica still waits for its echo (the front once closed that ping's socket
    under its watcher, which cancelled the front's every task)."""
    # Pings that wait for their echo longer than the test: one is sure to be waiting.
    heartbeat = HeartbeatPolicy(interval_s=0.1, timeout_s=600.0)
    async with nbos.LocalCluster(
        hosts=3, durable=True, heartbeat=heartbeat, replace_dead_replicas=False, run_dir=tmp_path
    ) as cluster:
        kernel = await cluster.start_kernel()
        executor = await run_cells(kernel, CELLS)
        node = next(r.node for r in kernel.replicas if r.node != executor)
        hb_port = int(cluster.kernel_manager.replica_connection(kernel.kernel_id, node)["hb_port"])
        await kernel.signal_replica(node, signal.SIGSTOP)
        with anyio.fail_after(30):  # until a ping waits in the frozen replica's socket
            while not unread_bytes(hb_port):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        await kernel.kill_replica(node)
        await kernel.restart_replica(node)
        await assert_recovered(kernel, AFTER)


async def committed_claims(client: AsyncKernelClient) -> None:
    """Return once the last executor's early claim of the next cell has committed.

    A comm message goes to the last executor, which puts it through the kernel's log
    after that claim (its proposals commit in order); the front's idle for it follows.
    """
    content = {"comm_id": uuid.uuid4().hex, "target_name": "nbos-test-barrier", "data": {}}
    msg = client.session.msg("comm_open", content)
    client.shell_channel.send(msg)
    with anyio.fail_after(30):
        while True:
            status = await client.get_iopub_msg()
            if (
                status["parent_header"].get("msg_id") == msg["header"]["msg_id"]
                and status["msg_type"] == "status"
                and status["content"]["execution_state"] == "idle"
            ):
                return


async def test_a_cell_whose_executor_froze_runs_once_when_it_thaws(
    cluster: LocalCluster, kernel: Kernel, tmp_path: Path
) -> None:
    executor = await run_cells(kernel, CELLS)
    ran = tmp_path / "ran"
    async with connected_client(kernel) as client:
        await committed_claims(client)
    # Frozen between cells, with the next cell's claim already won: suspicion only, so
    # the cell is neither declared lost nor run elsewhere; it waits for its executor.
    await kernel.signal_replica(executor, signal.SIGSTOP)
    results: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def cell() -> None:
            code = f"open({str(ran)!r}, 'a').write('ran')"
            results.append(await kernel.execute(code, timeout=120))

        tg.start_soon(cell)
        await eventually(lambda: executor not in kernel.front.alive, timeout=60)
        assert not ran.exists() and not results
        await kernel.signal_replica(executor, signal.SIGCONT)
    [result] = results
    assert result.status == "ok", result.reply
    assert ran.read_text() == "ran"  # once
    await eventually(lambda: executor in kernel.front.alive, timeout=60)
    digests = await kernel.digests()
    assert len(digests) == 3 and len(set(digests.values())) == 1, digests


async def test_two_restarts_of_one_replica_at_once_start_one_process(cluster: LocalCluster) -> None:
    # The kernel's own recovery and an operator (or a chaos heal) may restart the same dead
    # replica together: a second process on one Raft log would be two members in one.
    kernel = await cluster.start_kernel()
    try:
        executor = await run_cells(kernel, CELLS)
        node = next(r.node for r in kernel.replicas if r.node != executor)
        await kernel.kill_replica(node)
        started: list[int] = []
        real_restart = kernel._restart
        assert real_restart is not None

        async def counted(n: int) -> Any:
            started.append(n)
            return await real_restart(n)

        kernel._restart = counted
        async with anyio.create_task_group() as tg:
            tg.start_soon(kernel.restart_replica, node)
            tg.start_soon(kernel.restart_replica, node)
        assert started == [node]
        await assert_recovered(kernel, AFTER)
    finally:
        await kernel.shutdown()
