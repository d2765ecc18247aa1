"""Elections: randomized timeouts, vote persistence, check-quorum, pre-vote, transfer."""

from __future__ import annotations

import random

import pytest

from nbos.core.errors import NotLeaderError
from nbos.core.wire.raft import RaftVote, RaftVoteResponse
from nbos.raft.core import RaftConfig, RaftNode, Role, bootstrap
from nbos.raft.core.sim import Durable
from tests.raft.conftest import MakeCluster


def test_one_leader_emerges_and_everyone_follows_it(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=7)
    leader = cluster.wait_leader()
    cluster.run(3)
    for nid in (1, 2, 3):
        assert cluster.node(nid).leader_id == leader
        assert cluster.node(nid).term == cluster.node(leader).term
    assert [cluster.node(n).role for n in (1, 2, 3)].count(Role.LEADER) == 1


def test_single_voter_group_elects_itself(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(1)
    assert cluster.wait_leader() == 1
    index = cluster.node(1).propose(b"x")
    cluster.process(1)
    assert cluster.members[1].applied[index].data == b"x"


def test_vote_and_term_survive_a_crash(config: RaftConfig) -> None:
    durable = Durable.of(bootstrap([1, 2, 3]))
    node = RaftNode(1, durable.view(), config, random.Random(1))
    node.step(RaftVote(2, 1, 5, last_index=3, last_term=1))
    rd = node.ready()
    assert rd is not None
    # the grant leaves in the same Ready that carries the vote to persist: the driver
    # persists first, so no grant is ever sent for a vote that could be forgotten
    assert rd.hard_state is not None
    assert (rd.hard_state.term, rd.hard_state.vote) == (5, 2)
    assert rd.messages == [RaftVoteResponse(1, 2, 5, granted=True)]
    durable.persist(rd)
    node.advance(rd)

    reborn = RaftNode(1, durable.view(), config, random.Random(2))
    assert (reborn.term, reborn.vote) == (5, 2)
    reborn.step(RaftVote(3, 1, 5, last_index=3, last_term=1))
    reborn.step(RaftVote(2, 1, 5, last_index=3, last_term=1))
    rd = reborn.ready()
    assert rd is not None
    assert rd.messages == [
        RaftVoteResponse(1, 3, 5, granted=False),
        RaftVoteResponse(1, 2, 5, granted=True),
    ]


def test_vote_refused_to_a_stale_log(config: RaftConfig) -> None:
    view = bootstrap([1, 2, 3])
    node = RaftNode(1, view, config, random.Random(1))
    node.step(RaftVote(2, 1, 2, last_index=2, last_term=1))
    rd = node.ready()
    assert rd is not None
    assert rd.messages == [RaftVoteResponse(1, 2, 2, granted=False)]


def test_check_quorum_makes_an_isolated_leader_step_down(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3)
    old = cluster.wait_leader()
    others = {1, 2, 3} - {old}
    cluster.partition({old}, others)
    cluster.run(2 * cluster.config.election_ticks)
    assert cluster.node(old).role is Role.FOLLOWER
    new = cluster.wait_leader()
    assert new in others


def test_without_check_quorum_an_isolated_leader_stays(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3, check_quorum=False)
    old = cluster.wait_leader()
    cluster.partition({old}, {1, 2, 3} - {old})
    cluster.run(2 * cluster.config.election_ticks)
    assert cluster.node(old).role is Role.LEADER


@pytest.mark.parametrize("pre_vote", [True, False])
def test_pre_vote_keeps_a_rejoining_node_from_disrupting(
    make_cluster: MakeCluster, pre_vote: bool
) -> None:
    cluster = make_cluster(3, seed=5, pre_vote=pre_vote)
    leader = cluster.wait_leader()
    term = cluster.node(leader).term
    loner = max({1, 2, 3} - {leader})
    cluster.partition({loner}, {1, 2, 3} - {loner})
    cluster.run(10 * cluster.config.election_ticks)
    cluster.heal()
    cluster.run(3 * cluster.config.election_ticks)
    if pre_vote:
        assert cluster.node(loner).term == term
        assert cluster.leader() == leader
        assert cluster.node(leader).term == term
    else:
        # the counterfactual: without pre-vote the loner inflates its term and,
        # once back, forces the healthy leader out of its term
        assert cluster.node(cluster.wait_leader()).term > term


def test_leadership_transfer(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=11)
    old = cluster.wait_leader()
    target = min({1, 2, 3} - {old})
    for i in range(5):
        cluster.node(old).propose(b"%d" % i)
    cluster.process(old)
    cluster.node(old).transfer_leadership(target)
    with pytest.raises(NotLeaderError) as caught:
        cluster.node(old).propose(b"refused during transfer")
    assert caught.value.leader_hint == target
    cluster.process(old)
    cluster.deliver_all()
    assert cluster.leader() == target
    assert cluster.node(target).term == cluster.node(old).term
    with pytest.raises(NotLeaderError) as caught:
        cluster.node(old).propose(b"x")
    assert caught.value.leader_hint == target


def test_transfer_to_a_lagging_node_waits_for_it_to_catch_up(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=11)
    old = cluster.wait_leader()
    target = min({1, 2, 3} - {old})
    cluster.partition({target}, {1, 2, 3} - {target})
    for i in range(20):
        cluster.node(old).propose(b"%d" % i)
    cluster.run(2)
    cluster.heal()
    assert cluster.node(target).log.last_index() < cluster.node(old).log.last_index()
    cluster.node(old).transfer_leadership(target)
    cluster.process(old)
    cluster.run(3)  # the next heartbeat answer resumes the paused probe
    assert cluster.leader() == target
    assert cluster.node(target).log.last_index() >= cluster.node(old).log.last_index()
