"""Replica failure: the kernel goes on with two replicas; a cell lost mid-run is reported.

Each test kills replicas, so each gets a kernel of its own (on one shared cluster).
"""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.core.config import RaftSettings, Settings
from nbos.kernel.front import HeartbeatPolicy
from tests._digests import assert_replicas_agree
from tests._servers._process import process_running
from tests._wait import eventually
from tests.kernel.conftest import (
    connected_client,
    reply_to,
    run_cells,
    start_cell,
)

pytestmark = pytest.mark.anyio

# Values, a function and a class defined in cells, an instance, shared references,
# a large array (a blob in the object store).
STATE = [
    "import math\nimport numpy as np\nxs = [1, 2, 3]\nalias = xs\nnested = {'xs': xs}\n"
    "big = np.arange(300_000, dtype=np.float64)\nview = {'big': big}",
    "def area(r):\n    return math.pi * r * r\n"
    "class Point:\n    def __init__(self, x):\n        self.x = x\n"
    "    def norm(self):\n        return abs(self.x)",
    "p = Point(-4)\nxs.append(4)",
]
CHECK = (
    "assert alias is xs and nested['xs'] is xs and xs == [1, 2, 3, 4]\n"
    "assert view['big'] is big and big.sum() == 299_999 * 300_000 / 2\n"
    "assert isinstance(p, Point) and p.norm() == 4\n"
    "print(round(area(1), 5))"
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    # Heartbeats a little faster than the default, so a frozen replica is noticed in
    # about 3 s, yet slow enough that a busy test machine does not drop a live one.
    heartbeat = HeartbeatPolicy(interval_s=0.25, timeout_s=1.0, misses=3)
    # These tests are about a kernel going on with 2 of 3: no replacements
    # (tests/kernel/test_replicated_replacement.py has those).
    async with nbos.LocalCluster(
        hosts=3, durable=False, heartbeat=heartbeat, replace_dead_replicas=False
    ) as c:
        yield c


async def test_kill_a_non_executor_between_cells(kernel: Kernel) -> None:
    executor = await run_cells(kernel, STATE)
    victim = next(r.node for r in kernel.replicas if r.node != executor)
    await kernel.kill_replica(victim)
    assert victim not in kernel.front.alive
    result = await kernel.execute(CHECK)
    assert result.status == "ok", result.reply
    assert result.stdout == "3.14159\n"
    more = await kernel.execute("xs.append(5)\nprint(len(alias))")
    assert more.stdout == "5\n"
    digests = await kernel.digests()
    assert sorted(digests) == sorted(set(kernel.front.alive))
    assert len(set(digests.values())) == 1


async def test_kill_the_executor_between_cells(kernel: Kernel) -> None:
    executor = await run_cells(kernel, STATE)
    model = await kernel.execute(
        "import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loss = model(torch.ones(3, 8)).sum()\nloss.backward()\nopt.step()\n"
        "weights = model.weight.detach().clone()"
    )
    assert model.status == "ok", model.reply
    executor = model.executor or executor
    before = await kernel.digests()
    assert len(set(before.values())) == 1
    await kernel.kill_replica(executor)
    result = await kernel.execute(  # changes nothing: the namespace is the old one
        CHECK + "\nassert torch.equal(model.weight, weights) and model.weight.grad is not None"
    )
    assert result.status == "ok", result.reply
    assert result.executor is not None and result.executor != executor
    assert result.stdout == "3.14159\n"
    after = await kernel.digests()
    assert set(after) == set(before) - {executor}
    assert set(after.values()) == set(before.values())
    # The input history came through the log too: the new executor has every cell.
    async with connected_client(kernel) as client:
        history = await client.history(hist_access_type="tail", n=10, reply=True, timeout=10)
    codes = [entry[2] for entry in history["content"]["history"]]
    assert codes[: len(STATE)] == STATE


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of ``pid`` so far, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def until_idle(kernel: Kernel, window: float = 1.0) -> None:
    """Until no live replica of ``kernel`` used a clock tick of CPU for ``window`` seconds.

    An awake Raft group ticks every 10 ms and heartbeats every 20 ms, several percent of
    a core per replica; a quiesced one does nothing at all.
    """
    pids = [r.pid for r in kernel.replicas if r.alive and r.pid is not None]
    with anyio.fail_after(60):
        while True:
            before = [cpu_ticks(pid) for pid in pids]
            await anyio.sleep(window)
            if [cpu_ticks(pid) for pid in pids] == before:
                return


async def test_an_idle_kernel_takes_no_cpu_and_survives_the_death_of_its_executor(
    kernel: Kernel,
) -> None:
    executor = await run_cells(kernel, STATE)
    await until_idle(kernel)
    # The executor leads the kernel's quiesced Raft group: the survivors time nothing
    # until they are woken (by the front, at the death, and by the next cell's claim).
    await kernel.kill_replica(executor)
    result = await kernel.execute(CHECK)
    assert result.status == "ok", result.reply
    assert result.executor is not None and result.executor != executor
    assert result.stdout == "3.14159\n"


CAMPAIGNS = "campaigns for the Raft leadership of replica"


async def test_the_executors_exit_has_a_survivor_campaign_and_the_next_cell_runs_once(
    kernel: Kernel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nbos.kernel.front")
    executor = await run_cells(kernel, [*STATE, "count = 0"])
    await until_idle(kernel)
    pid = next(r.pid for r in kernel.replicas if r.node == executor)
    assert pid is not None
    # Killed from outside, as a crash: the cluster learns of it from the process exit,
    # and the cell sent at once may reach the dead replica first (then it is lost).
    os.kill(pid, signal.SIGKILL)
    replies = [await kernel.execute("count += 1")]
    while replies[-1].status != "ok":
        assert replies[-1].error is not None and replies[-1].error[0] == "CellLostError"
        assert len(replies) < 5, [r.reply for r in replies]
        replies.append(await kernel.execute("count += 1"))
    # The exit is proof: the survivor that cells go to first campaigned at once, as
    # the dead leader's successor, rather than after an election timeout.
    survivor = min(r.node for r in kernel.replicas if r.node != executor)
    assert f"replica {survivor} {CAMPAIGNS} {executor}" in caplog.text
    assert replies[-1].executor == survivor
    # Each acknowledged cell ran once, a lost one not at all, on both survivors alike.
    check = await kernel.execute(CHECK + "\nprint(count)")
    assert (check.status, check.stdout) == ("ok", "3.14159\n1\n"), check.reply
    await assert_replicas_agree(kernel, replicas=2)


async def test_the_survivor_asked_to_campaign_is_not_woken_again(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = await run_cells(kernel, ["count = 0"])
    await until_idle(kernel)
    relay = kernel.front._relay
    real = relay.control_request
    sent: list[tuple[int, str]] = []

    async def recorded(replica: int, msg_type: str, content: Any, **kw: Any) -> Any:
        sent.append((replica, msg_type))
        return await real(replica, msg_type, content, **kw)

    monkeypatch.setattr(relay, "control_request", recorded)
    await kernel.kill_replica(executor)
    campaigner, other = sorted(r.node for r in kernel.replicas if r.node != executor)
    # The quiesced survivors are woken to time their leader again; the one asked to
    # campaign was woken by that request, and a wake queued on it would hold up the
    # settle of a cell lost with the executor (it serves control requests in turn).
    await eventually(lambda: (other, "kernel_info_request") in sent, timeout=30)
    assert (campaigner, "nbos_leader_gone_request") in sent
    assert (campaigner, "kernel_info_request") not in sent, sent
    result = await kernel.execute("count += 1\nprint(count)")
    assert (result.status, result.stdout, result.executor) == ("ok", "1\n", campaigner)


async def test_a_leader_gone_request_with_bad_content_gets_an_error_reply(kernel: Kernel) -> None:
    executor = await run_cells(kernel, ["count = 1"])
    for bad in ({}, {"node": "1"}, {"node": True}, {"node": None}):
        reply = await kernel.front.control_request(
            executor, "nbos_leader_gone_request", bad, timeout=30
        )
        assert reply is not None and reply["content"]["status"] == "error", bad
    # Naming itself: a replica never campaigns for its own death.
    reply = await kernel.front.control_request(
        executor, "nbos_leader_gone_request", {"node": executor}, timeout=30
    )
    assert reply is not None and reply["content"] == {"status": "ok", "campaigned": False}
    result = await kernel.execute("count += 1\nprint(count)")
    assert (result.status, result.stdout, result.executor) == ("ok", "2\n", executor)


async def test_kill_the_executor_mid_cell(kernel: Kernel) -> None:
    await run_cells(kernel, STATE)
    before = await kernel.digests()
    async with connected_client(kernel) as client:
        msg_id = await start_cell(client, "xs.append('lost')\nimport time\ntime.sleep(60)")
        executor = kernel.front.running_on
        assert executor is not None
        await kernel.kill_replica(executor)
        reply = await reply_to(client, msg_id)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "CellLostError"
    assert f"cell {kernel.front.last_exec_index} was lost" in reply["content"]["evalue"]
    result = await kernel.execute(CHECK)  # the lost append is not there; nothing re-ran
    assert result.status == "ok", result.reply
    after = await kernel.digests()
    assert set(after.values()) == set(before.values())
    assert len(after) == 2


async def test_a_frozen_executor_keeps_its_cell_and_once_thawed_finishes_it(
    kernel: Kernel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nbos.kernel.front")
    await run_cells(kernel, STATE)
    async with connected_client(kernel) as client:
        msg_id = await start_cell(client, "import time\ntime.sleep(1)\nxs.append('late')")
        executor = kernel.front.running_on
        assert executor is not None
        pid = next(r.pid for r in kernel.replicas if r.node == executor)
        assert pid is not None
        await kernel.signal_replica(executor, signal.SIGSTOP)  # no exit: only heartbeats stop
        await eventually(lambda: executor not in kernel.front.alive, timeout=60)
        # Suspicion is not proof: left out, not killed, and its cell is not given up
        # while it may still finish it.
        assert process_running(pid) and kernel.front.unresponsive(executor)
        with anyio.move_on_after(3.0):
            await reply_to(client, msg_id)
            pytest.fail("the frozen executor's cell got a reply")
        await kernel.signal_replica(executor, signal.SIGCONT)
        reply = await reply_to(client, msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    await eventually(lambda: executor in kernel.front.alive, timeout=60)
    result = await kernel.execute("print(xs[-1])")
    assert (result.status, result.stdout) == ("ok", "late\n"), result.reply
    after = await kernel.digests()
    assert len(set(after.values())) == 1 and len(after) == 3, after
    # Suspicion deposes no leader: nobody was asked to campaign in its place.
    assert CAMPAIGNS not in caplog.text


async def test_a_restarted_replica_catches_up_from_its_log_and_a_snapshot() -> None:
    # Snapshots every few entries, so the leader compacts past the dead replica and has
    # to send it a snapshot; replicas re-image their namespace after every cell, so the
    # snapshot holds a namespace image (plus the deltas after it).
    settings = Settings(raft=RaftSettings(snapshot_every=4))
    async with nbos.LocalCluster(
        hosts=3, durable=True, settings=settings, rebase_bytes=1, replace_dead_replicas=False
    ) as cluster:
        kernel = await cluster.start_kernel()
        executor = await run_cells(kernel, STATE)
        victim = next(r.node for r in kernel.replicas if r.node != executor)
        await kernel.kill_replica(victim)
        for _ in range(4):  # cells it misses
            assert (await kernel.execute("xs.append(len(xs))")).status == "ok"
        await kernel.restart_replica(victim)
        assert victim in kernel.front.alive
        await assert_replicas_agree(kernel)
        # Once the others are gone from under it, it runs cells on that state.
        await kernel.kill_replica(executor)
        result = await kernel.execute("print(xs[-1], len(alias), p.norm())")
        assert result.stdout == "7 8 4\n", result.reply


async def test_without_a_majority_cells_fail_at_once_as_the_kernel_is_dead(kernel: Kernel) -> None:
    first = await kernel.execute("x = 1")
    for victim in [r.node for r in kernel.replicas if r.node != first.executor]:
        await kernel.kill_replica(victim)
    # Nothing restarts or replaces them here: the kernel is dead, and says why.
    with anyio.fail_after(20):
        result = await kernel.execute("x = 2")
    assert result.error is not None and result.error[0] == "KernelDeadError"
    assert f"only replicas [{first.executor}] of [1, 2, 3] are alive" in result.error[1]
    # An error output too: a notebook shows outputs, not the reply.
    errors = [o["content"]["ename"] for o in result.outputs if o["msg_type"] == "error"]
    assert errors == ["KernelDeadError"]


SEED_AND_DRAW = (
    "import os, random\nimport numpy as np\nimport torch\n"
    "random.seed(7)\nnp.random.seed(7)\ntorch.manual_seed(7)\n"
    "os.chdir({cwd!r})\nos.environ['NBOS_TEST_VAR'] = 'set by a cell'\n"
)
DRAW = "print(repr((random.random(), float(np.random.rand()), torch.rand(1).item())))"


def expected_draws(seed: int, n: int) -> list[str]:
    """What ``DRAW`` prints ``n`` times in one ipykernel after ``SEED_AND_DRAW``."""
    import numpy as np
    import torch

    py, legacy = random.Random(seed), np.random.RandomState(seed)
    gen = torch.Generator().manual_seed(seed)
    return [
        repr((py.random(), float(legacy.rand()), torch.rand(1, generator=gen).item())) + "\n"
        for _ in range(n)
    ]


async def test_global_generators_cwd_and_environment_survive_a_failover(
    kernel: Kernel, tmp_path: Path
) -> None:
    first = await kernel.execute(SEED_AND_DRAW.format(cwd=str(tmp_path)) + DRAW)
    assert first.status == "ok", first.reply
    async with connected_client(kernel) as client:  # which no replica's generator sees
        for _ in range(3):
            await client.kernel_info(reply=True, timeout=30)
    second = await kernel.execute(DRAW)
    assert [first.stdout, second.stdout] == expected_draws(7, 2)
    await assert_replicas_agree(kernel)
    assert second.executor is not None
    await kernel.kill_replica(second.executor)
    third = await kernel.execute(DRAW)
    assert third.executor != second.executor
    assert third.stdout == expected_draws(7, 3)[-1], third.reply
    where = await kernel.execute("print(os.getcwd(), os.environ.get('NBOS_TEST_VAR'))")
    assert where.stdout == f"{tmp_path} set by a cell\n"
    after = await kernel.digests()
    assert len(after) == 2 and len(set(after.values())) == 1, after


async def test_a_replica_restored_from_a_snapshot_holds_the_executors_generators(
    tmp_path: Path,
) -> None:
    settings = Settings(raft=RaftSettings(snapshot_every=4))
    async with nbos.LocalCluster(
        hosts=3, durable=True, settings=settings, rebase_bytes=1, replace_dead_replicas=False
    ) as cluster:
        kernel = await cluster.start_kernel()
        first = await kernel.execute(SEED_AND_DRAW.format(cwd=str(tmp_path)) + DRAW)
        assert first.status == "ok", first.reply
        victim = next(r.node for r in kernel.replicas if r.node != first.executor)
        await kernel.kill_replica(victim)
        # Cells it misses: the leader compacts past them, so it comes back from a
        # snapshot, whose image alone holds the second draw's generator states.
        for code in [DRAW, "n = 1", "n = 2", "n = 3"]:
            assert (await kernel.execute(code)).status == "ok"
        await kernel.restart_replica(victim)
        # The digest covers the generators: the victim holds the executor's.
        await assert_replicas_agree(kernel)
        executor = kernel.front.last_executor
        assert executor is not None and executor != victim
        await kernel.kill_replica(executor)
        drawn = await kernel.execute(DRAW)
        assert drawn.stdout == expected_draws(7, 3)[-1], drawn.reply
