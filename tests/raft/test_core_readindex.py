"""ReadIndex: linearizable read points confirmed by a heartbeat round."""

from __future__ import annotations

import pytest

from nbos.core.errors import NotLeaderError
from nbos.core.wire.raft import RaftVote, RaftVoteResponse
from nbos.raft.core import ReadState, Role
from tests.raft.conftest import MakeCluster


def test_leader_read_needs_a_heartbeat_quorum(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    cluster.node(leader).propose(b"x")
    cluster.process(leader)
    cluster.deliver_all()
    commit = cluster.node(leader).commit_index
    cluster.node(leader).read_index(b"r1")
    cluster.process(leader)
    assert cluster.members[leader].read_states == []  # not before a quorum answers
    cluster.deliver_all()
    assert cluster.members[leader].read_states == [ReadState(commit, b"r1")]


def test_follower_read_is_answered_through_the_leader(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=2)
    leader = cluster.wait_leader()
    follower = min({1, 2, 3} - {leader})
    cluster.node(follower).read_index(b"r2")
    cluster.process(follower)
    cluster.deliver_all()
    states = cluster.members[follower].read_states
    assert states == [ReadState(cluster.node(leader).commit_index, b"r2")]


def test_read_without_a_known_leader_is_refused(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3)
    with pytest.raises(NotLeaderError):
        cluster.node(1).read_index(b"r")


def test_a_deposed_leader_never_answers_a_read(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=4, check_quorum=False)
    old = cluster.wait_leader()
    cluster.partition({old}, {1, 2, 3} - {old})
    cluster.node(old).read_index(b"stale")
    cluster.process(old)
    cluster.run(4 * cluster.config.election_ticks)
    new = cluster.leader()
    assert new is not None
    assert new != old  # the higher-term leader is on the majority side
    cluster.node(new).propose(b"newer write")
    cluster.process(new)
    cluster.run(5)
    assert cluster.node(old).role is Role.LEADER
    assert cluster.members[old].read_states == []


def test_a_new_leader_answers_reads_only_after_committing_in_its_term(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(3, seed=5)
    votes = (RaftVote, RaftVoteResponse)
    cluster.elect_on_votes(2)
    node = cluster.node(2)
    assert node.log.term(node.commit_index) != node.term
    node.read_index(b"early")
    cluster.process(2)
    cluster.deliver_where(lambda m: not isinstance(m, votes) and m.dst != 2)  # no acks yet
    assert cluster.members[2].read_states == []
    cluster.deliver_all()
    assert node.log.term(node.commit_index) == node.term
    assert cluster.members[2].read_states == [ReadState(node.commit_index, b"early")]
