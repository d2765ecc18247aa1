"""Snapshots: compaction, chunked InstallSnapshot to a lagging node, races with membership."""

from __future__ import annotations

import pytest

from nbos.core.errors import ReplicationError
from nbos.core.wire.raft import ConfChange, RaftSnapshotChunk
from nbos.raft.core import Role
from tests.raft.conftest import MakeCluster


def test_compaction_drops_applied_entries_only(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=1)
    leader = cluster.wait_leader()
    node = cluster.node(leader)
    with pytest.raises(ReplicationError):
        node.compact(node.applied_index + 1, b"image")
    cluster.compact(leader)
    assert node.log.offset == node.applied_index
    assert node.snapshot.meta.index == node.applied_index
    assert node.snapshot.meta.conf.voters == [1, 2, 3]


def test_lagging_follower_is_caught_up_by_a_chunked_snapshot(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=2, snapshot_chunk_bytes=50)
    leader = cluster.wait_leader()
    lagger = min({1, 2, 3} - {leader})
    cluster.partition({lagger}, {1, 2, 3} - {lagger})
    for i in range(30):
        cluster.node(leader).propose(b"value %d" % i)
    cluster.process(leader)
    cluster.run(2)
    cluster.compact(leader)
    image = cluster.node(leader).snapshot
    cluster.heal()
    cluster.trace = []
    cluster.run(6)
    chunks = [m for m in cluster.trace if isinstance(m, RaftSnapshotChunk)]
    assert len(chunks) >= len(image.data) // 50
    assert chunks[-1].done
    assert cluster.node(lagger).log.offset == image.meta.index
    assert cluster.members[lagger].applied == cluster.members[leader].applied
    # what the lagger persisted is enough to come back with the same state
    assert cluster.members[lagger].durable.snapshot == image.meta
    cluster.crash(lagger)
    cluster.restart(lagger)
    assert cluster.members[lagger].applied == cluster.members[leader].applied
    cluster.check_logs()


def test_lost_chunks_are_resent(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, seed=3, snapshot_chunk_bytes=40)
    leader = cluster.wait_leader()
    lagger = min({1, 2, 3} - {leader})
    cluster.crash(lagger)
    for i in range(20):
        cluster.node(leader).propose(b"value %d" % i)
    cluster.process(leader)
    cluster.run(2)
    cluster.compact(leader)
    cluster.restart(lagger)
    dropped = seen = 0
    for _ in range(40):
        cluster.tick()
        while cluster.network:
            if isinstance(cluster.network[0], RaftSnapshotChunk):
                seen += 1
                if seen % 2 == 0 and dropped < 3:  # lose every other chunk, 3 in all
                    del cluster.network[0]
                    dropped += 1
                    continue
            cluster.deliver(0)
    assert dropped == 3
    assert cluster.node(lagger).log.offset == cluster.node(leader).snapshot.meta.index
    assert cluster.members[lagger].applied == cluster.members[leader].applied


@pytest.mark.parametrize("compact_after_change", [False, True])
def test_snapshot_racing_a_membership_change(
    make_cluster: MakeCluster, compact_after_change: bool
) -> None:
    """A new learner is caught up by a snapshot taken just before or just after its admission.

    Taken before, the snapshot's membership lacks the learner and the change
    reaches it as a log entry after the snapshot; taken after, the snapshot
    itself carries it. Either way it ends up a learner, then a voter.
    """
    cluster = make_cluster(3, seed=4, snapshot_chunk_bytes=64)
    leader = cluster.wait_leader()
    for i in range(10):
        cluster.node(leader).propose(b"value %d" % i)
    cluster.process(leader)
    cluster.run(2)
    if not compact_after_change:
        cluster.compact(leader)
    cluster.add_node(4)
    cluster.node(leader).propose_conf_change(ConfChange("add_learner", 4))
    cluster.process(leader)
    if compact_after_change:
        cluster.deliver_all()  # committed and applied on the leader
        cluster.compact(leader)
        assert cluster.node(leader).snapshot.meta.conf.learners == [4]
    else:
        assert 4 not in cluster.node(leader).snapshot.meta.conf.learners
    cluster.run(8)
    learner = cluster.node(4)
    assert learner.conf.learners == [4]
    assert learner.log.offset == cluster.node(leader).snapshot.meta.index
    assert cluster.members[4].applied == cluster.members[leader].applied
    cluster.node(leader).propose_conf_change(ConfChange("promote", 4))
    cluster.process(leader)
    cluster.run(3)
    assert cluster.node(4).conf.voters == [1, 2, 3, 4]
    assert cluster.node(leader).conf.voters == [1, 2, 3, 4]
    # the promoted node now counts: with two voters down, 3 of 4 still commit
    cluster.crash(min({1, 2, 3} - {leader}))
    index = cluster.node(leader).propose(b"after promotion")
    cluster.process(leader)
    cluster.run(2)
    assert cluster.members[4].applied[index].data == b"after promotion"
    assert cluster.node(leader).role is Role.LEADER
    cluster.check_logs()
