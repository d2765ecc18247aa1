"""The anyio Raft driver over the in-memory network: proposals, reads, failover, membership."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    LogClosedError,
    MembershipChangeError,
    NotLeaderError,
    ProposalTimeoutError,
    RaftStateMissingError,
)
from nbos.core.ids import NodeId, PeerId
from nbos.core.wire import encode
from nbos.core.wire.log_commands import Proposal
from nbos.core.wire.raft import RaftForward
from nbos.raft import Outcome, RaftReplicatedLog, open_raft_log
from nbos.raft.kv import KeyValueStateMachine, encode_command
from nbos.transport import MemoryNetwork
from tests._wait import eventually

pytestmark = pytest.mark.anyio

SETTINGS = RaftSettings(tick_ms=5, election_ticks=10, heartbeat_ticks=2, snapshot_every=50)


def peer(node: int) -> PeerId:
    return PeerId(f"raft/{node}")


class Group:
    """A Raft group of driver-run nodes on one in-memory network."""

    def __init__(self, network: MemoryNetwork, tmp: Path | None) -> None:
        self.network = network
        self.tmp = tmp
        self.nodes: dict[int, RaftReplicatedLog] = {}
        self.machines: dict[int, KeyValueStateMachine] = {}
        self.stops: dict[int, Callable[[], object]] = {}

    async def start(
        self,
        tg: anyio.abc.TaskGroup,
        node: int,
        members: list[int],
        join: bool = False,
        settings: RaftSettings = SETTINGS,
    ) -> None:
        started = anyio.Event()
        scope = anyio.CancelScope()
        machine = KeyValueStateMachine()
        self.machines[node] = machine

        async def run() -> None:
            with scope:
                transport = self.network.endpoint(peer(node))
                try:
                    for m in members:
                        if m != node:
                            transport.add_peer(peer(m), f"mem://{peer(m)}")
                    async with open_raft_log(
                        node_id=NodeId(node),
                        members={NodeId(m): peer(m) for m in members},
                        transport=transport,
                        data_dir=None if self.tmp is None else self.tmp / str(node),
                        state_machine=machine,
                        settings=settings,
                        join=join,
                        seed=node,
                    ) as raft:
                        self.nodes[node] = raft
                        started.set()
                        await anyio.sleep_forever()
                finally:
                    self.nodes.pop(node, None)
                    await transport.aclose()

        tg.start_soon(run)
        self.stops[node] = scope.cancel
        await started.wait()

    def stop(self, node: int) -> None:
        self.stops.pop(node)()

    async def leader(self, timeout: float = 5.0) -> RaftReplicatedLog:
        with anyio.fail_after(timeout):
            while True:
                for raft in self.nodes.values():
                    if raft.leader_id == raft.node_id:
                        return raft
                await anyio.sleep(0.01)

    async def put(self, key: str, value: str, **kw: object) -> bytes:
        for _ in range(50):
            leader = await self.leader()
            try:
                return await leader.propose(encode_command("put", key, value), timeout=2.0, **kw)  # type: ignore[arg-type]
            except (NotLeaderError, ProposalTimeoutError, LogClosedError):
                await anyio.sleep(0.02)
        raise AssertionError("no leader accepted the proposal")

    async def converged(self, nodes: list[int], timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while True:
                images = [self.machines[n].data for n in nodes]
                indexes = {self.nodes[n].applied_index for n in nodes if n in self.nodes}
                if all(i == images[0] for i in images) and len(indexes) == 1:
                    return
                await anyio.sleep(0.01)


@asynccontextmanager
async def group(
    members: list[int],
    tmp: Path | None = None,
    settings: dict[int, RaftSettings] | None = None,
    **net: object,
) -> AsyncIterator[Group]:
    """``settings``: a node's own, where it differs from :data:`SETTINGS`."""
    g = Group(MemoryNetwork(seed=1, **net), tmp)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        for node in members:
            await g.start(tg, node, members, settings=(settings or {}).get(node, SETTINGS))
        yield g
        tg.cancel_scope.cancel()


async def test_proposals_commit_and_apply_everywhere() -> None:
    async with group([1, 2, 3]) as g:
        for i in range(20):
            assert await g.put(f"k{i % 5}", str(i)) == str(i).encode()
        await g.converged([1, 2, 3])
        assert g.machines[1].data == {f"k{i}": str(15 + i) for i in range(5)}


async def test_follower_refuses_with_leader_hint() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        follower = next(r for n, r in g.nodes.items() if n != leader.node_id)
        await eventually(lambda: follower.leader_id == leader.node_id)
        with pytest.raises(NotLeaderError) as info:
            await follower.propose(encode_command("put", "a", "1"))
        assert info.value.leader_hint == leader.node_id


async def test_retried_proposal_applies_once() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        data = encode_command("append", "log", "x")
        first = await leader.propose(data, client_id="c", seq=1)
        again = await leader.propose(data, client_id="c", seq=1)
        assert first == again == b"x"
        assert await leader.propose(data, client_id="c", seq=2) == b"xx"
        await g.converged([1, 2, 3])
        assert g.machines[2].data["log"] == "xx"


async def test_read_index_sees_every_acknowledged_write() -> None:
    async with group([1, 2, 3]) as g:
        await g.put("k", "v")
        leader = await g.leader()
        index = await leader.read_index()
        assert leader.applied_index >= index
        assert g.machines[int(leader.node_id)].data["k"] == "v"


async def test_leader_failure_elects_a_new_leader_without_losing_writes() -> None:
    async with group([1, 2, 3]) as g:
        for i in range(5):
            await g.put("k", str(i))
        old = await g.leader()
        g.stop(int(old.node_id))
        await g.put("after", "failover")
        new = await g.leader()
        assert new.node_id != old.node_id
        survivors = [n for n in (1, 2, 3) if n != old.node_id]
        await g.converged(survivors)
        assert g.machines[survivors[0]].data == {"k": "4", "after": "failover"}


async def test_an_idle_group_quiesces_and_a_proposal_replaces_its_dead_leader() -> None:
    async with group([1, 2, 3]) as g:
        await g.put("k", "v")
        await eventually(lambda: all(g.nodes[n].quiesced for n in (1, 2, 3)), timeout=30)
        leader = await g.leader()
        g.stop(int(leader.node_id))
        follower = next(raft for raft in g.nodes.values() if raft is not leader)
        # A quiesced follower times nothing: the proposal to forward wakes it, it elects
        # a leader with the other survivor, and hands the proposal to that one.
        assert await follower.propose(encode_command("put", "k", "w"), forward=True) == b"w"
        assert (await g.leader()).node_id != leader.node_id


async def test_a_follower_forwards_its_proposal_and_returns_once_applied_there() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        node, follower = next((n, r) for n, r in g.nodes.items() if r is not leader)
        for i in range(5):
            put = encode_command("put", "k", str(i))
            assert await follower.propose(put, forward=True) == str(i).encode()
            assert g.machines[node].data["k"] == str(i)  # applied here before it returned
        await g.converged([1, 2, 3])


async def test_propose_nowait_settles_as_the_entry_applies_and_says_why_it_failed() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        node, follower = next((n, r) for n, r in g.nodes.items() if r is not leader)
        await eventually(lambda: follower.leader_id == leader.node_id)
        seen: list[str] = []
        settled = anyio.Event()

        def on_done(outcome: Outcome[bytes]) -> None:
            # On the node loop, the moment the entry applied on that node.
            seen.append(f"{outcome.result().decode()} {g.machines[node].data['k']}")
            settled.set()

        put = encode_command("put", "k", "v1")
        follower.propose_nowait(put, client_id="c", seq=1, forward=True, on_done=on_done)
        with anyio.fail_after(10):
            await settled.wait()
        assert seen == ["v1 v1"]
        # A retry of what applied is settled at once, with the first result.
        retry: list[bytes] = []
        follower.propose_nowait(
            put, client_id="c", seq=1, on_done=lambda o: retry.append(o.result())
        )
        assert retry == [b"v1"]
        # A follower that is not asked to forward refuses, through the same callback.
        refused: list[Outcome[bytes]] = []
        follower.propose_nowait(put, client_id="c", seq=2, on_done=refused.append)
        await eventually(lambda: len(refused) == 1)
        with pytest.raises(NotLeaderError):
            refused[0].result()


async def test_a_proposal_the_new_leader_holds_already_applies_once() -> None:
    async with group([1, 2, 3]) as g:
        old = await g.leader()
        f, m = (n for n in (1, 2, 3) if n != old.node_id)
        follower = g.nodes[f]
        await eventually(lambda: follower.leader_id == old.node_id)
        # The follower reaches the leader, but the leader no longer reaches it: the
        # entry commits with the third member while the follower never learns of it.
        g.network.cut(peer(int(old.node_id)), peer(f))
        data = encode_command("append", "log", "x")
        async with anyio.create_task_group() as tg:
            results: list[bytes] = []

            async def propose() -> None:
                results.append(await follower.propose(data, client_id="c", seq=1, forward=True))

            tg.start_soon(propose)
            await eventually(lambda: g.machines[m].data.get("log") == "x", timeout=30)
            # A new leader: the follower hands the same proposal to it.
            g.stop(int(old.node_id))
        assert results == [b"x"]
        assert g.nodes[m].leader_id != old.node_id
        await g.converged([f, m], timeout=30)
        assert g.machines[f].data["log"] == g.machines[m].data["log"] == "x"


async def test_a_proposal_the_dead_leader_kept_to_itself_goes_to_the_next_one() -> None:
    async with group([1, 2, 3]) as g:
        old = await g.leader()
        lost = old._node.log.last_index()
        f = next(n for n in (1, 2, 3) if n != old.node_id)
        await eventually(lambda: g.nodes[f].leader_id == old.node_id)
        for n in (1, 2, 3):  # the leader hears the others but reaches no one
            g.network.cut(peer(int(old.node_id)), peer(n))
        data = encode_command("append", "log", "x")
        async with anyio.create_task_group() as tg:
            results: list[bytes] = []

            async def propose() -> None:
                results.append(await g.nodes[f].propose(data, forward=True, timeout=30))

            tg.start_soon(propose)
            await eventually(lambda: old._node.log.last_index() > lost, timeout=30)
            g.stop(int(old.node_id))  # with the only copy of the entry
        assert results == [b"x"]
        survivors = [n for n in (1, 2, 3) if n != old.node_id]
        await g.converged(survivors, timeout=30)
        assert all(g.machines[n].data["log"] == "x" for n in survivors)


async def test_a_proposal_made_with_no_leader_goes_to_the_next_one_without_a_tick() -> None:
    # Node 3's ticks never come (a minute apart): what it does comes from messages and
    # calls alone. Its proposal, forwarded to a leader that died, must go to the next
    # leader as soon as there is one, not at its next tick (a settle of a cell lost
    # with the dead executor waited for it, up to a tick after the survivor led).
    never = msgspec.structs.replace(SETTINGS, tick_ms=60_000)
    async with group([1, 2, 3], settings={3: never}) as g:
        old = await g.leader()
        await g.put("k", "v")
        await eventually(lambda: g.nodes[3].leader_id == old.node_id, timeout=30)
        g.stop(int(old.node_id))
        survivor = g.nodes[3]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                results: list[bytes] = []

                async def propose() -> None:
                    put = encode_command("put", "k", "w")
                    results.append(await survivor.propose(put, forward=True, timeout=60))

                tg.start_soon(propose)
                await eventually(lambda: bool(survivor._forwarding.tracked), timeout=30)
                # Proof of the leader's death: node 3 campaigns at once (unless the other
                # survivor's election, which node 3 voted in, made a leader first).
                await survivor.campaign_for_dead_leader(old.node_id)
        assert results == [b"w"]
        assert survivor.leader_id is not None and survivor.leader_id != old.node_id


async def test_a_proposal_forwarded_twice_applies_once() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        f = next(n for n in (1, 2, 3) if n != leader.node_id)
        # Two copies of one forward, as a follower sends after a lost message or a
        # leader change; a stand-in sends them, so both surely reach the leader.
        sender = g.network.endpoint(PeerId("raft/stand-in"))
        sender.add_peer(peer(int(leader.node_id)), f"mem://{peer(int(leader.node_id))}")
        proposal = Proposal("c", 1, encode_command("append", "log", "x"))
        forward = RaftForward(f, int(leader.node_id), 0, proposals=[proposal])
        for _ in range(2):
            await sender.send(peer(int(leader.node_id)), encode(forward))
        await eventually(lambda: all(m.data.get("log") for m in g.machines.values()))
        await g.put("after", "both")  # both copies are in the log before this entry
        await g.converged([1, 2, 3])
        assert all(m.data["log"] == "x" for m in g.machines.values())
        await sender.aclose()


async def test_a_leaders_own_proposal_waits_out_a_transfer_to_a_dead_member() -> None:
    # The executor asks for leadership after each cell; killed right after, it leaves
    # the leader transferring to a dead member, which refuses proposals until the
    # transfer is given up (an election timeout later).
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        dead = next(n for n in (1, 2, 3) if n != leader.node_id)
        g.stop(dead)
        await leader.transfer_leadership(NodeId(dead))
        put = encode_command("put", "k", "v")
        assert await leader.propose(put, forward=True, timeout=30) == b"v"


async def test_a_follower_without_a_leader_to_forward_to_times_out() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        survivor = next(n for n in (1, 2, 3) if n != leader.node_id)
        for node in (1, 2, 3):
            if node != survivor:
                g.stop(node)
        with pytest.raises(ProposalTimeoutError):
            await g.nodes[survivor].propose(b"no quorum", forward=True, timeout=1.0)


async def test_a_follower_asks_for_leadership_and_gets_it() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        follower = next(r for r in g.nodes.values() if r is not leader)
        await eventually(lambda: follower.leader_id == leader.node_id)
        with anyio.fail_after(30):
            while follower.leader_id != follower.node_id:
                await follower.ask_for_leadership()
                await anyio.sleep(0.05)


async def test_learner_catches_up_from_snapshot_and_is_promoted() -> None:
    async with group([1, 2, 3]) as g, anyio.create_task_group() as tg:
        for i in range(120):  # past snapshot_every, so the learner needs the snapshot
            await g.put(f"k{i % 7}", str(i))
        await g.start(tg, 4, [1, 2, 3], join=True)
        leader = await g.leader()
        await leader.add_learner(NodeId(4), peer(4), f"mem://{peer(4)}")
        await g.converged([1, 2, 3, 4])
        # The learner's state can be complete before the leader has heard it acknowledge
        # the last entry: until then the core refuses the promotion, as it should.
        with anyio.fail_after(30):
            while True:
                try:
                    await leader.promote(NodeId(4))
                    break
                except MembershipChangeError:
                    await anyio.sleep(0.02)
        assert NodeId(4) in leader.voters()
        old = int(leader.node_id)
        await leader.remove(NodeId(old))
        assert NodeId(old) not in (await g.leader()).voters()
        await g.put("with", "four")
        await g.converged([n for n in (1, 2, 3, 4) if n != old])
        tg.cancel_scope.cancel()


async def test_restart_from_disk_keeps_state(tmp_path: Path) -> None:
    async with group([1, 2, 3], tmp=tmp_path) as g, anyio.create_task_group() as tg:
        for i in range(70):
            await g.put("k", str(i))
        await g.converged([1, 2, 3])
        g.stop(3)
        await anyio.sleep(0.05)
        await g.start(tg, 3, [1, 2, 3])
        await g.put("k", "last")
        await g.converged([1, 2, 3])
        assert g.machines[3].data["k"] == "last"
        tg.cancel_scope.cancel()


async def test_leaving_the_block_normally_closes_cleanly() -> None:
    network = MemoryNetwork(seed=3)
    transport = network.endpoint(peer(1))
    async with open_raft_log(
        node_id=NodeId(1),
        members={NodeId(1): peer(1)},
        transport=transport,
        data_dir=None,
        state_machine=KeyValueStateMachine(),
        settings=SETTINGS,
    ) as raft:
        with anyio.fail_after(20):
            while raft.leader_id != raft.node_id:  # noqa: ASYNC110 - a single node elects itself
                await anyio.sleep(0.005)
        await raft.propose(encode_command("put", "k", "v"))
        # Leave without cancelling anything: ticks keep arriving while the log closes.
    await transport.aclose()


async def test_a_node_recovering_refuses_a_data_dir_that_lost_its_state(tmp_path: Path) -> None:
    """``recover=True`` restarts from the node's state on disk, and only from it: a data
    dir emptied (a disk replaced) raises instead of bootstrapping a group afresh."""
    network = MemoryNetwork(seed=4)
    transport = network.endpoint(peer(1))
    opened = partial(
        open_raft_log,
        node_id=NodeId(1),
        members={NodeId(1): peer(1)},
        transport=transport,
        data_dir=tmp_path / "raft",
        state_machine=KeyValueStateMachine(),
        settings=SETTINGS,
    )
    with pytest.raises(RaftStateMissingError):
        async with opened(recover=True):
            pass
    async with opened() as raft:
        with anyio.fail_after(20):
            while raft.leader_id != raft.node_id:  # noqa: ASYNC110 - a single node elects itself
                await anyio.sleep(0.005)
        await raft.propose(encode_command("put", "k", "v"))
    machine = KeyValueStateMachine()
    async with opened(recover=True, state_machine=machine):
        with anyio.fail_after(20):
            while machine.data.get("k") != "v":  # noqa: ASYNC110 - applied from the log
                await anyio.sleep(0.005)
    await transport.aclose()
