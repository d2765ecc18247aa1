"""The core's parts on their own: log, progress, quorum, conf changes, wire messages."""

from __future__ import annotations

import pytest

from nbos.core.errors import ConfigError, DecodeError, MembershipChangeError, ReplicationError
from nbos.core.wire import decode, encode
from nbos.core.wire.raft import (
    ConfChange,
    ConfState,
    Entry,
    RaftAppend,
    RaftAppendResponse,
    RaftHeartbeat,
    RaftHeartbeatResponse,
    RaftPeerMessages,
    RaftReadIndex,
    RaftReadIndexResponse,
    RaftSnapshotChunk,
    RaftSnapshotResponse,
    RaftTimeoutNow,
    RaftVote,
    RaftVoteResponse,
    RaftWake,
    SnapshotMeta,
)
from nbos.raft.core import RaftConfig, RaftLog, apply_change, bootstrap, decode_change
from nbos.raft.core.progress import Progress, ProgressState
from nbos.raft.core.quorum import VoteResult, committed_index, vote_result


def _log(*terms: int) -> RaftLog:
    return RaftLog(0, 0, [Entry(term=t, index=i) for i, t in enumerate(terms, start=1)])


def test_log_truncates_a_conflicting_suffix_but_never_a_committed_entry() -> None:
    log = _log(1, 1, 2, 2)
    log.commit_to(2)
    assert log.maybe_append(2, 1, 3, [Entry(term=3, index=3)]) == 3
    assert [e.term for e in log.entries] == [1, 1, 3]
    assert log.committed == 3
    assert log.stable == 2  # the replaced entries must be rewritten
    with pytest.raises(ReplicationError):
        log.append([Entry(term=4, index=3)])
    assert log.maybe_append(3, 2, 3, []) is None


def test_log_from_storage_skips_entries_under_the_snapshot_and_refuses_gaps() -> None:
    log = RaftLog(2, 1, [Entry(term=1, index=i) for i in (1, 2, 3, 4)])
    assert (log.first_index(), log.last_index(), log.stable) == (3, 4, 4)
    with pytest.raises(ReplicationError):
        RaftLog(0, 0, [Entry(term=1, index=1), Entry(term=1, index=3)])


def test_log_conflict_hint_skips_whole_terms() -> None:
    log = _log(1, 1, 2, 2, 2, 2)
    assert log.find_conflict_by_term(6, 1) == 2
    assert log.find_conflict_by_term(9, 5) == 6
    assert log.find_conflict_by_term(6, 0) == 0


def test_log_compaction_keeps_the_offset_term() -> None:
    log = _log(1, 2, 3)
    log.commit_to(3)
    log.applied_to(2)
    log.compact(2)
    assert (log.first_index(), log.term(2), log.term(1)) == (3, 2, None)
    with pytest.raises(ReplicationError):
        log.slice(2, 4)


def test_progress_probe_backs_off_with_the_hint_and_replicate_pipelines() -> None:
    pr = Progress(next_index=11, max_inflight=2, learner=False)
    pr.sent_append(10, 0)
    assert pr.paused()
    assert not pr.maybe_decrease(rejected=7, hint=3)  # stale: not the probe in flight
    assert pr.maybe_decrease(rejected=10, hint=3)
    assert (pr.next, pr.paused()) == (4, False)
    pr.maybe_update(5)
    pr.become_replicate()
    pr.sent_append(7, 2)
    pr.sent_append(9, 2)
    assert pr.paused() and pr.state is ProgressState.REPLICATE and pr.next == 10
    pr.inflights.free_to(7)
    assert not pr.paused()


def test_quorum_arithmetic() -> None:
    assert committed_index([1, 2, 3], {1: 9, 2: 5, 3: 1}) == 5
    assert committed_index([1, 2, 3, 4], {1: 9, 2: 5, 3: 1, 4: 7}) == 5
    assert vote_result([1, 2, 3], {1: True, 2: True}) is VoteResult.WON
    assert vote_result([1, 2, 3], {1: True, 2: False}) is VoteResult.PENDING
    assert vote_result([1, 2, 3], {1: True, 2: False, 3: False}) is VoteResult.LOST


def test_conf_changes_validate() -> None:
    conf = ConfState(voters=[1, 2])
    conf = apply_change(conf, ConfChange("add_learner", 3))
    assert (conf.voters, conf.learners) == ([1, 2], [3])
    conf = apply_change(conf, ConfChange("promote", 3))
    assert (conf.voters, conf.learners) == ([1, 2, 3], [])
    with pytest.raises(MembershipChangeError):
        apply_change(conf, ConfChange("promote", 3))
    with pytest.raises(MembershipChangeError):
        apply_change(ConfState(voters=[1]), ConfChange("remove", 1))
    with pytest.raises(DecodeError):
        decode_change(b"\xff\x00")
    with pytest.raises(MembershipChangeError):
        bootstrap([1, 1])


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        RaftConfig(election_ticks=1, heartbeat_ticks=1)
    with pytest.raises(ConfigError):
        RaftConfig(max_inflight=0)


META = SnapshotMeta(index=4, term=2, conf=ConfState(voters=[1, 2, 3], learners=[4]))
MESSAGES: list[RaftPeerMessages] = [
    RaftVote(1, 2, 3, last_index=4, last_term=2, pre_vote=True, transfer=True),
    RaftVoteResponse(2, 1, 3, granted=True, pre_vote=True),
    RaftAppend(1, 2, 3, prev_index=4, prev_term=2, commit=4, entries=[Entry(3, 5, data=b"x")]),
    RaftAppendResponse(2, 1, 3, index=4, reject=True, hint_index=2, hint_term=1),
    RaftHeartbeat(1, 2, 3, commit=4, ctx=b"c"),
    RaftHeartbeat(1, 2, 3, commit=4, quiesce=True),
    RaftHeartbeatResponse(2, 1, 3, ctx=b"c"),
    RaftSnapshotChunk(1, 2, 3, meta=META, offset=0, data=b"img", done=True),
    RaftSnapshotResponse(2, 1, 3, snapshot_index=4, offset=3),
    RaftTimeoutNow(1, 2, 3),
    RaftReadIndex(2, 1, 3, ctx=b"r"),
    RaftReadIndexResponse(1, 2, 3, ctx=b"r", index=4),
    RaftWake(2, 1, 3),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_peer_messages_round_trip_the_wire(msg: RaftPeerMessages) -> None:
    assert decode(encode(msg)) == msg
