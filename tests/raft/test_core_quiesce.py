"""Quiescence: an idle group stops heartbeating and timing, and anything wakes it."""

from __future__ import annotations

import random

import pytest

from nbos.core.config import RaftSettings
from nbos.core.errors import NotLeaderError
from nbos.core.wire.raft import RaftHeartbeat, RaftHeartbeatResponse, RaftWake
from nbos.raft.core import RaftConfig, RaftNode, Role, bootstrap
from nbos.raft.core.sim import SimCluster
from nbos.raft.driver import core_config
from tests.raft.conftest import MakeCluster

QUIESCE = 5


def quiet_group(make_cluster: MakeCluster, seed: int = 3) -> tuple[SimCluster, int]:
    cluster = make_cluster(3, seed=seed, quiesce_ticks=QUIESCE)
    leader = cluster.wait_leader()
    cluster.run(3 * QUIESCE)
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))
    return cluster, leader


def silent_for(cluster: SimCluster, ticks: int) -> bool:
    """Tick ``ticks`` times; whether no node sent anything."""
    cluster.trace = []
    cluster.run(ticks)
    sent, cluster.trace = cluster.trace, None
    return not sent


def test_an_idle_group_goes_silent_and_stays_led(make_cluster: MakeCluster) -> None:
    cluster, leader = quiet_group(make_cluster)
    term = cluster.node(leader).term
    assert silent_for(cluster, 200)  # 20 election timeouts: nobody campaigns
    assert [cluster.node(n).term for n in (1, 2, 3)] == [term] * 3
    assert cluster.leader() == leader


def test_a_busy_group_does_not_quiesce(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3, quiesce_ticks=QUIESCE)
    leader = cluster.wait_leader()
    for i in range(10 * QUIESCE):
        cluster.node(leader).propose(b"%d" % i)
        cluster.run(1)
        assert not any(cluster.node(n).quiesced for n in (1, 2, 3))


def test_quiescing_is_off_by_default(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3)
    cluster.wait_leader()
    cluster.run(100)
    assert not any(cluster.node(n).quiesced for n in (1, 2, 3))


def test_a_kernels_group_goes_quiet_within_an_election_timeout_by_default() -> None:
    # What an awake group costs per sporadic cell is its ticks (bench/cell_cpu.py): with
    # the defaults, one cell's commit is followed by at most an election timeout of them.
    settings = RaftSettings()
    cluster = SimCluster.bootstrapped([1, 2, 3], core_config(settings), seed=3)
    leader = cluster.wait_leader()
    index = cluster.node(leader).propose(b"cell")
    cluster.run(settings.election_ticks + 2 * settings.heartbeat_ticks)
    assert all(cluster.node(n).applied_index >= index for n in (1, 2, 3))
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))


def test_a_proposal_wakes_the_group_which_quiesces_again(make_cluster: MakeCluster) -> None:
    cluster, leader = quiet_group(make_cluster)
    index = cluster.node(leader).propose(b"x")
    assert not cluster.node(leader).quiesced
    cluster.process(leader)
    # the append, then the commit: the heartbeat round after the append skips the
    # followers it reached, the next one tells them
    cluster.run(3)
    assert all(cluster.members[n].applied[index].data == b"x" for n in (1, 2, 3))
    cluster.run(3 * QUIESCE)
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))


def test_a_woken_follower_gets_a_live_leader_to_heartbeat_without_an_election(
    make_cluster: MakeCluster,
) -> None:
    cluster, leader = quiet_group(make_cluster)
    follower = next(n for n in (1, 2, 3) if n != leader)
    term = cluster.node(leader).term
    with pytest.raises(NotLeaderError):
        cluster.node(follower).propose(b"x")  # to be forwarded: the follower wakes
    assert not cluster.node(follower).quiesced
    cluster.run(10 * QUIESCE)
    assert cluster.leader() == leader and cluster.node(leader).term == term
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))


def test_a_dead_leader_is_replaced_once_a_follower_wakes(make_cluster: MakeCluster) -> None:
    cluster, leader = quiet_group(make_cluster)
    cluster.crash(leader)
    survivors = [n for n in (1, 2, 3) if n != leader]
    # Quiesced followers time nothing: a dead leader goes unnoticed while nothing asks.
    assert silent_for(cluster, 200)
    cluster.node(survivors[0]).wake()
    # The woken follower campaigns after its election timeout; the other one, woken by
    # the vote request, no longer vouches for the leader it last heard of (no lease).
    for _ in range(2 * cluster.config.election_ticks + 10):
        cluster.run(1)
        if cluster.leader() in survivors:
            break
    new = cluster.leader()
    assert new in survivors
    index = cluster.node(new).propose(b"after")
    cluster.process(new)
    cluster.run(2)
    assert all(cluster.members[n].applied[index].data == b"after" for n in survivors)


def test_a_restarted_member_wakes_the_leader_and_rejoins_without_a_new_term(
    make_cluster: MakeCluster,
) -> None:
    cluster, leader = quiet_group(make_cluster)
    follower = next(n for n in (1, 2, 3) if n != leader)
    term = cluster.node(leader).term
    cluster.crash(follower)
    cluster.restart(follower)  # not quiesced: it times the leader, then pre-votes
    cluster.run(4 * cluster.config.election_ticks)
    assert cluster.leader() == leader and cluster.node(leader).term == term
    assert cluster.node(follower).leader_id == leader
    cluster.run(3 * QUIESCE)
    assert all(cluster.node(n).quiesced for n in (1, 2, 3))


def test_a_follower_missing_entries_answers_a_quiesce_with_a_wake(config: RaftConfig) -> None:
    node = RaftNode(1, bootstrap([1, 2, 3]), config, random.Random(1))
    last = node.log.last_index()
    node.step(RaftHeartbeat(2, 1, 1, commit=last + 2, quiesce=True))
    rd = node.ready()
    assert rd is not None and rd.messages == [RaftWake(1, 2, 1)]
    assert not node.quiesced and node.role is Role.FOLLOWER


def test_a_late_heartbeat_answer_leaves_the_leader_quiet(make_cluster: MakeCluster) -> None:
    cluster, leader = quiet_group(make_cluster)
    follower = next(n for n in (1, 2, 3) if n != leader)
    node = cluster.node(leader)
    node.step(RaftHeartbeatResponse(follower, leader, node.term, commit=node.commit_index))
    assert node.quiesced
    node.step(RaftWake(follower, leader, node.term))
    assert not node.quiesced


def test_bad_quiesce_ticks_are_refused() -> None:
    from nbos.core.errors import ConfigError

    with pytest.raises(ConfigError):
        RaftConfig(quiesce_ticks=-1)
