"""Replication: commit, batching, inflight window, fast back-off, Figure 8, stale leaders."""

from __future__ import annotations

import msgspec
import pytest

from nbos.core.errors import NotLeaderError, ReplicationError
from nbos.core.wire.raft import (
    Entry,
    HardState,
    RaftAppend,
    RaftAppendResponse,
    RaftHeartbeat,
)
from nbos.raft.core import RaftConfig, Role, StorageView, bootstrap
from nbos.raft.core.sim import SimCluster
from tests.raft.conftest import MakeCluster


def test_proposals_commit_and_apply_on_every_node(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    indexes = [cluster.node(leader).propose(b"v%d" % i) for i in range(10)]
    cluster.process(leader)
    cluster.run(2)
    for nid in (1, 2, 3):
        applied = cluster.members[nid].applied
        assert [applied[i].data for i in indexes] == [b"v%d" % i for i in range(10)]
    cluster.check_logs()


def test_follower_refuses_proposals_with_a_hint(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    follower = min({1, 2, 3} - {leader})
    with pytest.raises(NotLeaderError) as caught:
        cluster.node(follower).propose(b"x")
    assert caught.value.leader_hint == leader


def test_input_between_ready_and_advance_is_refused(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    node = cluster.node(leader)
    node.propose(b"x")
    rd = node.ready()
    assert rd is not None
    with pytest.raises(ReplicationError):
        node.tick()
    node.advance(rd)
    node.tick()


def test_appends_are_batched_and_pipelined(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=2, max_batch_bytes=500, max_inflight=4)
    leader = cluster.wait_leader()
    follower = min({1, 2, 3} - {leader})
    for i in range(40):
        cluster.node(leader).propose(b"%03d" % i + b"x" * 97)
    cluster.process(leader)
    appends = [m for m in cluster.network if isinstance(m, RaftAppend) and m.dst == follower]
    # 500-byte batches of ~116-byte entries, at most max_inflight of them in flight at once
    assert len(appends) == 4
    assert all(len(m.entries) == 4 for m in appends)
    cluster.run(3)
    assert cluster.node(follower).log.last_index() == cluster.node(leader).log.last_index()


def test_fast_backoff_skips_a_divergent_suffix_in_few_rounds(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=4, check_quorum=False)
    old = cluster.wait_leader()
    rest = {1, 2, 3} - {old}
    cluster.partition({old}, rest)
    for i in range(60):
        cluster.node(old).propose(b"doomed %d" % i)  # never commits: old is alone
    cluster.process(old)
    cluster.deliver_all()
    new = min(rest)
    cluster.elect(new)
    for i in range(60):
        cluster.node(new).propose(b"kept %d" % i)
    cluster.process(new)
    cluster.deliver_all()
    # a fresh leader starts probing `old` at its own last index, 60 entries past the fork
    third = max(rest)
    cluster.node(new).transfer_leadership(third)
    cluster.process(new)
    cluster.deliver_all()
    assert cluster.leader() == third
    cluster.heal()
    cluster.trace = []
    cluster.run(10)
    rejects = [m for m in cluster.trace if isinstance(m, RaftAppendResponse) and m.reject]
    assert 1 <= len(rejects) <= 2  # one per divergent term, not one per entry
    assert cluster.node(old).role is Role.FOLLOWER
    applied = cluster.members[old].applied
    assert not any(e.data.startswith(b"doomed") for e in applied.values())
    assert sum(e.data.startswith(b"kept") for e in applied.values()) == 60
    cluster.check_logs()


def test_a_stale_leader_cannot_commit(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(5, seed=6, check_quorum=False)
    old = cluster.wait_leader()
    minority = {old, min({1, 2, 3, 4, 5} - {old})}
    majority = {1, 2, 3, 4, 5} - minority
    cluster.partition(minority, majority)
    stale_commit = cluster.node(old).commit_index
    stale = cluster.node(old).propose(b"stale")
    cluster.run(30)
    assert cluster.node(old).role is Role.LEADER  # it still believes it leads...
    assert cluster.node(old).commit_index == stale_commit  # ...but commits nothing
    assert stale not in cluster.members[old].applied
    new = cluster.wait_leader()
    assert new in majority
    kept = cluster.node(new).propose(b"kept")
    cluster.process(new)
    cluster.run(2)
    cluster.heal()
    cluster.run(5)
    assert cluster.node(old).role is Role.FOLLOWER
    for nid in range(1, 6):
        assert cluster.members[nid].applied[kept].data == b"kept"
        assert all(e.data != b"stale" for e in cluster.members[nid].applied.values())
    cluster.check_logs()


def _figure8_views() -> dict[int, StorageView]:
    """Figure 8 (c) of the Raft paper, on top of 5 bootstrap entries.

    S1 led term 2 and wrote index 6 only locally; S5 led term 3 and wrote a
    different index 6 only locally. Everyone has since seen term 3.
    """
    base = bootstrap([1, 2, 3, 4, 5])
    boot = base.entries

    def view(extra: tuple[Entry, ...], vote: int | None = None) -> StorageView:
        return StorageView(HardState(term=3, vote=vote, commit=5), boot + extra)

    return {
        1: view((Entry(term=2, index=6, data=b"from term 2"),)),
        2: view(()),
        3: view(()),
        4: view(()),
        5: view((Entry(term=3, index=6, data=b"from term 3"),), vote=5),
    }


def test_figure8_entries_of_older_terms_are_not_committed_by_counting() -> None:
    config = RaftConfig(
        election_ticks=10, max_batch_bytes=1, max_inflight=1, pre_vote=False, check_quorum=False
    )
    cluster = SimCluster(_figure8_views(), config, seed=8)
    cluster.partition({1, 2, 3}, {4}, {5})
    cluster.elect_on_votes(1)
    assert cluster.node(1).term == 4
    noop = cluster.node(1).log.last_index()
    assert noop == 7

    # S1 (term 4) replicates its term-2 entry to S2 and S3, but not its term-4 no-op:
    # every append loses the no-op on the way (as if batched short)
    for _ in range(4):
        cluster.tick([1])
        while cluster.network:
            msg = cluster.network[0]
            if isinstance(msg, RaftAppend):
                kept = [e for e in msg.entries if e.index < noop]
                cluster.network[0] = msgspec.structs.replace(msg, entries=kept)
            cluster.deliver(0)
    for follower in (2, 3):
        assert cluster.node(follower).log.term(6) == 2
        assert cluster.node(1).progress[follower].match == 6
    # index 6 is on a majority {1, 2, 3}, yet, being of term 2, it is not committed
    assert cluster.node(1).commit_index == 5

    # which is right: S5 can still win (its last term 3 beats 2) and overwrite it
    cluster.crash(1)
    cluster.network.clear()
    cluster.partition({1}, {2, 3, 4, 5})
    cluster.elect(5)
    cluster.run(3)
    for nid in (2, 3, 4, 5):
        assert cluster.members[nid].applied[6].data == b"from term 3"
    cluster.restart(1)
    cluster.heal()
    cluster.run(5)
    assert cluster.members[1].applied[6].data == b"from term 3"
    cluster.check_logs()


def test_figure8_the_leaders_own_entry_commits_older_ones() -> None:
    config = RaftConfig(election_ticks=10, pre_vote=False)
    cluster = SimCluster(_figure8_views(), config, seed=8)
    cluster.partition({1, 2, 3}, {4}, {5})
    cluster.elect(1)
    cluster.run(2)
    # once the term-4 no-op reaches a majority, it commits index 6 (term 2) with it
    assert cluster.node(1).commit_index == 7
    assert cluster.members[2].applied[6].data == b"from term 2"
    cluster.heal()
    cluster.run(5)
    assert cluster.members[5].applied[6].data == b"from term 2"
    cluster.check_logs()


def test_followers_learn_a_commit_from_the_next_message_not_one_of_its_own(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(3, seed=1, heartbeat_ticks=3)
    leader = cluster.wait_leader()
    cluster.run(3)
    cluster.trace = []
    index = cluster.node(leader).propose(b"x")
    cluster.process(leader)
    cluster.deliver_all()
    assert cluster.node(leader).log.committed == index
    # Each follower got the entry and answered it: nothing more went out for the commit.
    appends = [m for m in cluster.trace if isinstance(m, RaftAppend)]
    assert [len(m.entries) for m in appends] == [1, 1]
    followers = sorted({1, 2, 3} - {leader})
    assert all(cluster.node(f).log.committed < index for f in followers)
    second = cluster.node(leader).propose(b"y")
    cluster.process(leader)
    cluster.deliver_where(lambda m: isinstance(m, RaftAppend))
    assert all(cluster.node(f).log.committed == index for f in followers)
    cluster.deliver_all()
    # A heartbeat carries the commit of the last entry: not the first round after the
    # append (that round skips the followers it reached), the second.
    cluster.run(6)
    assert all(cluster.node(f).log.committed == second for f in followers)
    assert all(cluster.members[f].applied[second].data == b"y" for f in followers)


def _led_three(make_cluster: MakeCluster, **config: int) -> tuple[SimCluster, int, list[int]]:
    """A group of three with a leader, and its two followers."""
    cluster = make_cluster(3, seed=1, **config)
    leader = cluster.wait_leader()
    return cluster, leader, sorted({1, 2, 3} - {leader})


def _propose(cluster: SimCluster, leader: int, data: bytes) -> None:
    """Propose ``data`` at the leader and deliver what follows (lost on a cut link)."""
    cluster.node(leader).propose(data)
    cluster.process(leader)
    cluster.deliver_all()


def _heartbeats_of_a_round(cluster: SimCluster, leader: int) -> list[tuple[int, bytes]]:
    """Tick the leader alone through one heartbeat round: to whom (and with which read
    context) its heartbeats went; delivered or, on a cut link, lost."""
    sent: list[RaftHeartbeat] = []
    for _ in range(cluster.node(leader).config.heartbeat_ticks):
        cluster.tick([leader])
        sent += [m for m in cluster.network if isinstance(m, RaftHeartbeat)]
        cluster.deliver_all()
    return sorted((m.dst, m.ctx) for m in sent)


def test_a_heartbeat_round_skips_the_followers_an_append_reached_since_the_last(
    make_cluster: MakeCluster,
) -> None:
    cluster, leader, (a, b) = _led_three(make_cluster, heartbeat_ticks=2, max_inflight=2)
    _heartbeats_of_a_round(cluster, leader)
    assert _heartbeats_of_a_round(cluster, leader) == [(a, b""), (b, b"")]

    _propose(cluster, leader, b"x")
    assert _heartbeats_of_a_round(cluster, leader) == []  # the append stood in for them
    assert _heartbeats_of_a_round(cluster, leader) == [(a, b""), (b, b"")]

    # b's link is cut: its appends are lost until its window is full, then none goes
    # to it, and it is heartbeaten while a is not
    cluster.partition({leader, a}, {b})
    for data in (b"y", b"z", b"w"):
        _propose(cluster, leader, data)
    _heartbeats_of_a_round(cluster, leader)
    _propose(cluster, leader, b"v")
    assert _heartbeats_of_a_round(cluster, leader) == [(b, b"")]

    # a read waits for a quorum's answers: its rounds go to every follower
    cluster.partition({leader}, {a, b})
    cluster.node(leader).read_index(b"r")
    _propose(cluster, leader, b"u")
    assert _heartbeats_of_a_round(cluster, leader) == [(a, b"r"), (b, b"r")]


def test_every_round_heartbeats_everyone_unless_two_rounds_fit_in_an_election_timeout(
    make_cluster: MakeCluster,
) -> None:
    cluster, leader, (a, b) = _led_three(make_cluster, heartbeat_ticks=5, election_ticks=10)
    _propose(cluster, leader, b"x")
    assert _heartbeats_of_a_round(cluster, leader) == [(a, b""), (b, b"")]
