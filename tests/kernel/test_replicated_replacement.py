"""A dead replica is replaced by a new Raft member on another host; the kernel has 3 again.

Real replica processes on a LocalCluster of 4 hosts (so the replacement can avoid the
dead replica's host too). Snapshots every few entries and a namespace image after
every cell, so a replacement catches up from a snapshot plus the log.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.core.config import RaftSettings, Settings
from nbos.core.errors import KernelError
from nbos.core.ids import PeerId
from nbos.core.transport import Transport
from nbos.core.wire import encode
from nbos.core.wire.raft import RaftTransferRequest
from nbos.transport import open_transport
from nbos.transport.ports import free_loopback_address
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
    bad_requests = ({"op": "add_learner", "node": 9}, {"op": "promote", "node": -1}, {"op": "x"})
    for bad in (*bad_requests, {"op": "remove"}, {"op": "members", "node": "1"}):
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


async def member_request(kernel: Kernel, **content: object) -> dict[str, Any]:
    """``content`` as an ``nbos_member_request`` to the Raft leader; its reply's content."""
    with anyio.fail_after(30):
        while True:
            for node in kernel.front.alive:
                reply = await kernel.front.control_request(
                    node, "nbos_member_request", content, timeout=10
                )
                assert reply is not None
                if reply["content"].get("ename") != "NotLeaderError":
                    return reply["content"]  # type: ignore[no-any-return]
            await anyio.sleep(0.2)  # no leader yet


async def raft_leader(kernel: Kernel) -> int:
    """The replica that answers a ``members`` request: the Raft leader."""
    with anyio.fail_after(30):
        while True:
            for node in kernel.front.alive:
                reply = await kernel.front.control_request(
                    node, "nbos_member_request", {"op": "members"}, timeout=10
                )
                if reply is not None and reply["content"].get("status") == "ok":
                    return node
            await anyio.sleep(0.2)  # no leader yet


async def test_each_membership_change_goes_to_the_leader_that_made_the_last(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A move's four membership requests each went first to the first live replica, and
    # one the leader refused for now (a learner not caught up yet) then to the next one:
    # a follower's NotLeaderError and a wait each time, a fifth of a migration's time.
    # The leader that answered, or that a follower named, is asked first now.
    await run_cells(kernel, STATE)
    # Moved, the leader is the last of the replicas asked: each request went to another first.
    leader = await raft_leader(kernel)
    asked: list[tuple[int, str]] = []
    request = kernel.front.control_request

    async def spy(replica: int, msg_type: str, content: Any, **kw: Any) -> Any:
        reply = await request(replica, msg_type, content, **kw)
        if msg_type == "nbos_member_request":
            answer = reply["content"] if reply is not None else {"status": "none"}
            asked.append((replica, answer.get("ename") or answer["status"]))
        return reply

    monkeypatch.setattr(kernel.front, "control_request", spy)
    new = await kernel.replace_replica(leader)
    monkeypatch.undo()
    answers = [answer for _, answer in asked]
    assert answers.count("ok") >= 4, asked  # members, add_learner, promote, remove
    for (target, answer), (following, _) in itertools.pairwise(asked):
        if answer in ("ok", "MembershipChangeError"):
            assert following == target, asked
    await check_converged(kernel, new)


async def test_a_member_the_kernel_does_not_know_is_removed_and_its_node_id_never_reused(
    kernel: Kernel,
) -> None:
    # What a gateway stopped between a replacement's add_learner and its record leaves:
    # a Raft member whose process its next start stopped. The next replacement removes
    # it and numbers its own replica past it (before, it reused the id: the add was
    # taken as done, with the stray's address, and the new replica never caught up).
    executor = await run_cells(kernel, STATE)
    stray = max(r.node for r in kernel.replicas) + 1
    added = await member_request(kernel, op="add_learner", node=stray, raft=free_loopback_address())
    assert added["status"] == "ok" and added["learners"] == [stray], added
    victim = next(r.node for r in kernel.replicas if r.node != executor)
    await kernel.kill_replica(victim)
    new = await replaced(kernel, victim)
    assert new == stray + 1
    members = await member_request(kernel, op="members")
    assert members["status"] == "ok", members
    assert sorted(members["voters"]) == sorted(r.node for r in kernel.replicas)
    assert members["learners"] == []
    await check_converged(kernel, new)


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


# Its pickling (capture, digest) waits for a flag file: a replica asked for its digest
# meanwhile stays busy while the test moves the Raft leadership.
GATE = """\
import os, time
class Gate:
    def __init__(self, path):
        self.path = path
    def __reduce__(self):
        while not os.path.exists(self.path):
            time.sleep(0.05)
        return (Gate, (self.path,))
gate = Gate({flag!r})
"""


def raft_address(pid: int, node: int) -> str:
    """Where ``node``'s Raft transport listens, from the ``--raft-peers`` of process ``pid``."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    peers = json.loads(argv[argv.index(b"--raft-peers") + 1])
    return str(peers[str(node)])


async def ask_leadership(transport: Transport, kernel: Kernel, node: int) -> None:
    """Send every live replica (the leader heeds it) the request that ``node`` makes for
    itself as an executor: hand leadership to ``node``."""
    for replica in kernel.replicas:
        if replica.alive and replica.pid is not None:
            member = PeerId(f"member-{replica.node}")
            transport.add_peer(member, raft_address(replica.pid, replica.node))
            await transport.send(member, encode(RaftTransferRequest(node, replica.node, 0)))


async def test_a_replacement_that_became_the_leader_still_gets_the_dead_member_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The dead member is removed once the new one is a voter, and the new one may win an
    # election by then (it did under load): the removal must reach it. Here the leadership
    # is handed to it while the replacement waits for its digest.
    caplog.set_level(logging.INFO, logger="nbos.gateway._replacement")
    flag = tmp_path / "flag"
    flag.touch()
    async with nbos.LocalCluster(hosts=4, durable=False, run_dir=tmp_path / "run") as cluster:
        kernel = await cluster.start_kernel()
        await run_cells(kernel, [GATE.format(flag=str(flag))])
        await kernel.digests()  # every replica has the gate
        flag.unlink()
        victim = next(r.node for r in kernel.replicas if r.node != kernel.front.last_executor)
        new = max(r.node for r in kernel.replicas) + 1
        nodes: list[int] = []

        async def replace() -> None:
            nodes.append(await kernel.replace_replica(victim))

        async with anyio.create_task_group() as tg:
            tg.start_soon(replace)
            with anyio.fail_after(60):
                # A voter now, it waits in the gate for the replacement's digest request.
                promoted = f"promote {new} done"
                while not any(promoted in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                    await anyio.sleep(0.1)  # log records come with no event to wait on
                log = next((tmp_path / "run" / "logs").glob(f"*/*-replica-{new}.log"))
                # The replicas listen with the transport a kernel without keys opens.
                async with await open_transport("test-asker", "tcp://127.0.0.1:0") as transport:
                    while f"node {new}: leader for term" not in log.read_text():
                        await ask_leadership(transport, kernel, new)
                        await anyio.sleep(0.2)
            flag.touch()
        assert nodes == [new] and victim not in {r.node for r in kernel.replicas}
        assert set(kernel.front.alive) == {r.node for r in kernel.replicas}
