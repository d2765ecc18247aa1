"""Membership: learners, promotion, removal, one change at a time."""

from __future__ import annotations

import pytest

from nbos.core.errors import MembershipChangeError
from nbos.core.wire.raft import ConfChange, RaftVote
from nbos.raft.core import Role
from tests.raft.conftest import MakeCluster


def test_learner_catches_up_without_counting_then_is_promoted(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    for i in range(5):
        cluster.node(leader).propose(b"before %d" % i)
    cluster.add_node(4)
    cluster.node(leader).propose_conf_change(ConfChange("add_learner", 4))
    cluster.process(leader)
    cluster.run(4)
    learner = cluster.node(4)
    assert learner.conf.learners == [4]
    assert cluster.members[4].applied == cluster.members[leader].applied
    for _ in range(5 * cluster.config.election_ticks):
        cluster.tick([4])  # a learner never campaigns
    assert learner.role is Role.FOLLOWER
    assert not [m for m in cluster.network if isinstance(m, RaftVote)]
    cluster.deliver_all()

    # the learner does not count: with two of three voters down nothing commits
    followers = sorted({1, 2, 3} - {leader})
    cluster.crash(followers[0])
    cluster.crash(followers[1])
    before = cluster.node(leader).commit_index
    cluster.node(leader).propose(b"needs a voter quorum")
    cluster.process(leader)
    cluster.deliver_all()
    assert cluster.node(leader).commit_index == before
    cluster.restart(followers[0])
    cluster.restart(followers[1])
    cluster.run(3)
    leader = cluster.wait_leader()

    cluster.node(leader).propose_conf_change(ConfChange("promote", 4))
    cluster.process(leader)
    cluster.run(3)
    assert cluster.node(4).conf.voters == [1, 2, 3, 4]
    assert cluster.node(4).promotable()
    cluster.check_logs()


def test_promotion_of_a_lagging_learner_is_refused(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=2)
    leader = cluster.wait_leader()
    cluster.add_node(4)
    cluster.crash(4)
    cluster.node(leader).propose_conf_change(ConfChange("add_learner", 4))
    cluster.process(leader)
    cluster.run(2)
    with pytest.raises(MembershipChangeError, match="caught up"):
        cluster.node(leader).propose_conf_change(ConfChange("promote", 4))


def test_one_change_at_a_time(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3)
    leader = cluster.wait_leader()
    cluster.add_node(4)
    cluster.node(leader).propose_conf_change(ConfChange("add_learner", 4))
    with pytest.raises(MembershipChangeError, match="pending"):
        cluster.node(leader).propose_conf_change(ConfChange("add_learner", 5))
    with pytest.raises(MembershipChangeError, match="not a member"):
        cluster.process(leader)
        cluster.run(2)
        cluster.node(leader).propose_conf_change(ConfChange("remove", 9))
    with pytest.raises(MembershipChangeError, match="already"):
        cluster.node(leader).propose_conf_change(ConfChange("add_learner", 4))


def test_a_new_leader_changes_membership_only_after_its_first_commit(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(3, seed=4)
    cluster.elect_on_votes(1)
    with pytest.raises(MembershipChangeError, match="pending"):
        cluster.node(1).propose_conf_change(ConfChange("remove", 3))
    cluster.deliver_all()
    cluster.node(1).propose_conf_change(ConfChange("remove", 3))


def test_removing_a_follower(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=5)
    leader = cluster.wait_leader()
    gone = max({1, 2, 3} - {leader})
    cluster.node(leader).propose_conf_change(ConfChange("remove", gone))
    cluster.process(leader)
    cluster.run(3)
    assert gone not in cluster.node(leader).conf.voters
    assert gone not in cluster.node(leader).progress
    assert not cluster.node(gone).promotable()
    cluster.crash(gone)
    index = cluster.node(leader).propose(b"two voters left")
    cluster.process(leader)
    cluster.run(2)
    stay = ({1, 2, 3} - {leader, gone}).pop()
    assert cluster.members[stay].applied[index].data == b"two voters left"


def test_a_removed_leader_steps_down_once_the_change_applies(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=6)
    old = cluster.wait_leader()
    cluster.node(old).propose_conf_change(ConfChange("remove", old))
    cluster.process(old)
    cluster.deliver_all()
    assert cluster.node(old).role is Role.FOLLOWER
    assert not cluster.node(old).promotable()
    # the leader handed off with TimeoutNow, so a successor is there without a timeout
    new = cluster.leader()
    assert new is not None
    assert new != old
    cluster.crash(old)
    index = cluster.node(new).propose(b"after removal")
    cluster.process(new)
    cluster.run(2)
    for nid in {1, 2, 3} - {old}:
        assert cluster.members[nid].applied[index].data == b"after removal"


def test_a_removed_leader_leaves_only_once_the_others_know(make_cluster: MakeCluster) -> None:
    """Two voters; the leader removes itself and is shut down the moment it steps down.

    Had it stepped down on applying the change, the survivor, not yet knowing the
    change committed, would still need the departed node's vote, forever.
    """
    cluster = make_cluster(2, seed=7)
    old = cluster.wait_leader()
    survivor = 3 - old
    cluster.node(old).propose_conf_change(ConfChange("remove", old))
    cluster.process(old)
    while cluster.node(old).role is Role.LEADER:
        cluster.deliver(0)
    cluster.crash(old)
    assert cluster.node(survivor).conf.voters == [survivor]
    cluster.network.clear()
    assert cluster.wait_leader() == survivor
    index = cluster.node(survivor).propose(b"alone")
    cluster.process(survivor)
    assert cluster.members[survivor].applied[index].data == b"alone"
