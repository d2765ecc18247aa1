"""A survivor campaigns at once on proof of its leader's death (its process ended).

No tick passes between the campaign and the new leader in these tests: the election
does not wait for an election timeout, whether the group was quiet or busy (the other
survivor's lease on the dead leader is set aside, as in a leadership transfer).
"""

from __future__ import annotations

from nbos.raft.core.node import Role
from nbos.raft.core.sim import SimCluster
from tests.raft.conftest import MakeCluster


def survivors_of(cluster: SimCluster, leader: int) -> list[int]:
    return [n for n in cluster.alive() if n != leader]


def propose_on(cluster: SimCluster, leader: int, data: bytes) -> int:
    index = cluster.node(leader).propose(data)
    cluster.process(leader)
    cluster.deliver_all()
    cluster.run(2)  # the commit reaches the followers with the next heartbeat round
    return index


def test_a_survivor_of_a_quiet_group_leads_without_a_tick(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3, quiesce_ticks=5)
    leader = cluster.wait_leader()
    acknowledged = propose_on(cluster, leader, b"acknowledged")
    cluster.run(20)
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))
    cluster.crash(leader)
    first, second = survivors_of(cluster, leader)

    assert cluster.node(first).campaign_for_dead_leader(leader)
    cluster.process(first)
    cluster.deliver_all()

    assert cluster.leader() == first
    assert cluster.node(second).leader_id == first
    # What the dead leader had acknowledged is there, and the new leader commits.
    index = propose_on(cluster, first, b"after")
    for n in (first, second):
        applied = cluster.members[n].applied
        assert applied[acknowledged].data == b"acknowledged" and applied[index].data == b"after"
    cluster.check_logs()


def test_a_busy_groups_survivor_leads_despite_the_other_ones_lease(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(3, seed=5)
    leader = cluster.wait_leader()
    propose_on(cluster, leader, b"x")
    cluster.crash(leader)
    first, second = survivors_of(cluster, leader)
    # ``second`` heard from the leader a moment ago: a plain (pre-)vote would be refused.
    assert not cluster.node(second).quiesced

    assert cluster.node(first).campaign_for_dead_leader(leader)
    cluster.process(first)
    cluster.deliver_all()

    assert cluster.leader() == first
    cluster.check_logs()


def test_a_live_leader_is_not_deposed(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=7)
    leader = cluster.wait_leader()
    term = cluster.node(leader).term
    first, second = survivors_of(cluster, leader)
    cluster.crash(second)

    # A follower whose process ended is named: the leader is not it.
    assert not cluster.node(first).campaign_for_dead_leader(second)
    # Nor does the leader campaign against itself, or a node for its own death.
    assert not cluster.node(leader).campaign_for_dead_leader(first)
    assert not cluster.node(first).campaign_for_dead_leader(first)
    cluster.run(5)

    assert cluster.leader() == leader and cluster.node(leader).term == term


def test_two_survivors_campaigning_at_once_still_elect_one(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=11)
    leader = cluster.wait_leader()
    cluster.crash(leader)
    first, second = survivors_of(cluster, leader)

    assert cluster.node(first).campaign_for_dead_leader(leader)
    assert cluster.node(second).campaign_for_dead_leader(leader)
    cluster.process(first)
    cluster.process(second)
    cluster.deliver_all()

    new = cluster.wait_leader()  # a split vote is settled by the election timeouts
    assert new in (first, second)
    propose_on(cluster, new, b"after")
    cluster.check_logs()


def test_no_campaign_once_the_survivors_elected_a_leader(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=13)
    leader = cluster.wait_leader()
    cluster.crash(leader)
    new = cluster.wait_leader()  # by election timeouts, before the news of the death came
    other = next(n for n in survivors_of(cluster, leader) if n != new)
    term = cluster.node(new).term

    assert not cluster.node(other).campaign_for_dead_leader(leader)
    cluster.run(5)

    assert cluster.leader() == new and cluster.node(new).term == term


def test_a_survivor_whose_log_is_behind_gives_way_to_the_other_without_a_tick(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(3, seed=17)
    leader = cluster.wait_leader()
    first, second = survivors_of(cluster, leader)
    # ``first`` misses the last acknowledged entry (cut off from the leader while the
    # leader and ``second`` committed it): asked to campaign, it cannot win.
    cluster.partition({first}, {leader, second})
    acknowledged = cluster.node(leader).propose(b"acknowledged")
    cluster.process(leader)
    cluster.deliver_all()
    assert (
        cluster.node(second).log.last_index() >= acknowledged > cluster.node(first).log.last_index()
    )
    cluster.heal()
    cluster.crash(leader)

    assert cluster.node(first).campaign_for_dead_leader(leader)
    cluster.process(first)
    cluster.deliver_all()

    # ``second`` refused it for its log and, its leader's death being proven, ran itself.
    assert cluster.leader() == second
    assert cluster.node(first).leader_id == second
    index = propose_on(cluster, second, b"after")
    for n in (first, second):
        applied = cluster.members[n].applied
        assert applied[acknowledged].data == b"acknowledged" and applied[index].data == b"after"
    cluster.check_logs()


def test_a_voter_does_not_run_against_a_candidate_that_can_win_elsewhere(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(5, seed=19)
    leader = cluster.wait_leader()
    first, second, *rest = survivors_of(cluster, leader)
    # ``second`` alone holds the last entry (still uncommitted); ``first`` may still win
    # with the votes of the other two, and ``second`` must not depose it.
    cluster.partition({first, *rest}, {leader, second})
    cluster.node(leader).propose(b"only on two")
    cluster.process(leader)
    cluster.deliver_all()
    cluster.heal()
    cluster.crash(leader)

    assert cluster.node(first).campaign_for_dead_leader(leader)
    cluster.process(first)
    cluster.deliver_all()

    assert cluster.leader() == first
    assert cluster.node(second).role is not Role.CANDIDATE
    cluster.check_logs()
