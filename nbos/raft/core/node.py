"""The Raft state machine of one node: ticks and messages in, a ``Ready`` out.

Nothing in here does I/O or reads a clock; see :mod:`nbos.raft.core` for the
driver contract. The structure follows etcd-io/raft: a follower, pre-candidate,
candidate or leader steps messages; the leader tracks a :class:`Progress` per
member and replicates from ``ready()``, which batches whatever was proposed or
acknowledged since the previous ``Ready``.
"""

from __future__ import annotations

import enum
import logging
import random

from nbos.core.errors import (
    DecodeError,
    MembershipChangeError,
    NotLeaderError,
    ReplicationError,
)
from nbos.core.wire.raft import (
    ConfChange,
    ConfState,
    Entry,
    EntryKind,
    HardState,
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
from nbos.raft.core.confchange import apply_change, decode_change, encode_change
from nbos.raft.core.config import RaftConfig, StorageView
from nbos.raft.core.log import RaftLog
from nbos.raft.core.progress import Progress, ProgressState
from nbos.raft.core.quorum import VoteResult, committed_index, has_quorum, vote_result
from nbos.raft.core.readindex import ReadOnlyQueue
from nbos.raft.core.ready import ReadState, Ready, Snapshot

log = logging.getLogger(__name__)

_FROM_LEADER = (RaftAppend, RaftHeartbeat, RaftSnapshotChunk)


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class RaftNode:
    """One member of a Raft group: ``tick``/``step``/``propose`` in, ``ready``/``advance`` out.

    Between a ``ready()`` that returned a ``Ready`` and the matching
    ``advance()``, no other input is accepted (``ReplicationError``): the driver
    runs one Ready at a time and queues what arrives meanwhile.
    """

    def __init__(
        self, node_id: int, storage: StorageView, config: RaftConfig, rng: random.Random
    ) -> None:
        self.id = node_id
        self.config = config
        self._rng = rng
        snap = storage.snapshot
        self.log = RaftLog(snap.index, snap.term, storage.entries)
        hs = storage.hard_state
        self.term, self.vote = hs.term, hs.vote
        self.log.commit_to(hs.commit)
        self.conf = snap.conf
        #: (index, membership from then on) of every applied change since the snapshot
        self._conf_history: list[tuple[int, ConfState]] = [(snap.index, snap.conf)]
        self._snapshot = Snapshot(snap, storage.snapshot_data)
        self._unstable_snapshot: Snapshot | None = None
        self._incoming: tuple[SnapshotMeta, bytearray] | None = None
        self._prev_hard = HardState(self.term, self.vote, self.log.committed)
        self._msgs: list[RaftPeerMessages] = []
        self._read_states: list[ReadState] = []
        self._outstanding: Ready | None = None
        self.role = Role.FOLLOWER
        self.leader_id: int | None = None
        self.progress: dict[int, Progress] = {}
        self._votes: dict[int, bool] = {}
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = config.election_ticks
        self.transferee: int | None = None
        self._pending_conf_index = 0
        #: a membership change committed: every follower is told at once
        self._conf_committed = False
        #: followers to send an append to even if it carries no entries
        self._nudge: set[int] = set()
        self._read_only = ReadOnlyQueue()
        self._reads_before_commit: list[tuple[bytes, int | None]] = []
        #: set on a leader that applied its own removal: the index of that change
        self._leaving_at: int | None = None
        #: new voters known to have committed past ``_leaving_at``
        self._informed: set[int] = set()
        #: The group is quiesced (see :meth:`wake`): ticks do nothing.
        self.quiesced = False
        #: A leader's count of ticks that the group was quiet at ``_quiet_index``.
        self._quiet_ticks = 0
        self._quiet_index = 0
        #: A follower woke from quiescence and has not heard from the leader since: what
        #: it knew of the leader's liveness is stale, so it grants no lease on it.
        self._lease_lost = False
        self._become_follower(self.term, None)

    # --- status -------------------------------------------------------------------

    @property
    def commit_index(self) -> int:
        return self.log.committed

    @property
    def applied_index(self) -> int:
        return self.log.applied

    @property
    def snapshot(self) -> Snapshot:
        """The latest snapshot this node holds (taken locally or installed)."""
        return self._snapshot

    @property
    def leaving(self) -> bool:
        """A leader that applied its own removal and is handing over (takes no proposals)."""
        return self._leaving_at is not None

    def promotable(self) -> bool:
        """Whether this node is a voter and may campaign."""
        return self.id in self.conf.voters

    # --- inputs -------------------------------------------------------------------

    def tick(self) -> None:
        """Advance logical time by one tick (none passes for a quiesced node)."""
        self._check_input()
        if self.quiesced:
            return
        if self.role is Role.LEADER:
            self._tick_leader()
            return
        self._election_elapsed += 1
        if self.promotable() and self._election_elapsed >= self._randomized_timeout:
            log.info("node %d: election timeout in term %d, campaigning", self.id, self.term)
            self._election_elapsed = 0
            self._campaign(transfer=False)

    def wake(self) -> None:
        """Leave quiescence: something needs the group (a client request, a proposal).

        A leader heartbeats at once; a follower restarts its election timer and asks
        the leader to heartbeat (:class:`RaftWake`), so it campaigns if the leader is
        gone. Proposals, reads and transfers wake the node themselves; a message does
        too, unless it is a late answer to a heartbeat that asks for nothing.
        """
        self._check_input()
        if self.quiesced:
            self._wake(notify=True)

    def propose(self, data: bytes) -> int:
        """Append ``data`` to the log as leader; returns its index (not yet committed).

        A follower refuses with ``NotLeaderError``, but wakes: it is about to forward
        the proposal to a leader that it must time again.
        """
        self.wake()
        self._check_leader()
        return self._append("normal", data)

    def propose_conf_change(self, change: ConfChange) -> int:
        """Propose one membership change; returns the index of its conf entry.

        Refused with ``MembershipChangeError`` while another change (or, on a new
        leader, its first entry) is not yet applied, when the change does not fit
        the membership, or when promoting a learner that has not caught up.
        """
        self.wake()
        self._check_leader()
        if self._pending_conf_index > self.log.applied:
            raise MembershipChangeError(
                f"a membership change at index {self._pending_conf_index} is still pending"
            )
        apply_change(self.conf, change)
        if change.kind == "promote":
            pr = self.progress.get(change.node)
            if pr is None or pr.match < self.log.committed:
                raise MembershipChangeError(f"learner {change.node} has not caught up yet")
        index = self._append("conf", encode_change(change))
        self._pending_conf_index = index
        return index

    def read_index(self, ctx: bytes) -> None:
        """Ask for a linearizable read point; the answer comes as a ``ReadState`` with ``ctx``.

        ``ctx`` must be unique per request (the driver's request id). On a
        follower the request goes to the leader; the answer may never come
        (leader change, lost message), so the driver needs a timeout.
        """
        self.wake()
        if self._leaving_at is not None:
            raise NotLeaderError(None)
        if self.role is Role.LEADER:
            self._leader_read(ctx, None)
        elif self.leader_id is None:
            raise NotLeaderError(None)
        else:
            self._send(RaftReadIndex(self.id, self.leader_id, self.term, ctx=ctx))

    def transfer_leadership(self, to: int) -> None:
        """Hand leadership to voter ``to`` once caught up; aborted after an election timeout."""
        self.wake()
        if self.role is not Role.LEADER:
            raise NotLeaderError(self.leader_id)
        if to not in self.conf.voters:
            raise MembershipChangeError(f"node {to} is not a voter")
        if to in (self.id, self.transferee):
            return
        self.transferee = to
        self._election_elapsed = 0
        if self.progress[to].match == self.log.last_index():
            self._send(RaftTimeoutNow(self.id, to, self.term))

    def campaign_for_dead_leader(self, dead: int) -> bool:
        """Campaign now: the process of node ``dead`` is known to have ended (proof, never
        suspicion: a silent leader may only be slow). Whether this node campaigned.

        Only while ``dead`` is the leader this node follows (not once an election is
        under way): a leadership transfer made on the dead leader's behalf, skipping the
        election timeout and, as ``RaftTimeoutNow`` does, pre-vote and the other voters'
        leases, which are leases on the dead leader. Votes are granted by the usual
        rules (up-to-date log, one vote per term), so safety is Raft's own; a second
        survivor that campaigns too splits the vote at worst, and the randomized
        timeouts settle it.
        """
        self._check_input()
        if dead == self.id or self.leader_id != dead or not self.promotable():
            log.info(
                "node %d: not campaigning for %d: %s of term %d, leader %s",
                self.id,
                dead,
                self.role.name.lower(),
                self.term,
                self.leader_id,
            )
            return False
        log.info("node %d: leader %d is gone, campaigning at once", self.id, dead)
        self._campaign(transfer=True, gone=dead)
        return True

    def compact(self, index: int, data: bytes) -> None:
        """The application snapshotted its state at ``index`` into ``data``: drop the log up to it.

        ``index`` must be applied. Call this only after storage holds the image
        durably; storage may then drop its entries up to ``index`` too. The node
        keeps ``data`` to send to followers that fall behind the compaction.
        """
        self._check_input()
        if index <= self.log.offset:
            return
        term = self.log.term(index)
        if index > self.log.applied or term is None:
            raise ReplicationError(f"cannot compact to {index}: applied is {self.log.applied}")
        meta = SnapshotMeta(index=index, term=term, conf=self._conf_at(index))
        self.log.compact(index)
        self._snapshot = Snapshot(meta, data)
        kept = [(i, c) for i, c in self._conf_history if i > index]
        self._conf_history = [(index, meta.conf), *kept]

    def step(self, msg: RaftPeerMessages) -> None:
        """Take one message from a peer."""
        self._check_input()
        if msg.dst != self.id or msg.src == self.id:
            log.warning("node %d: dropping misaddressed %s", self.id, type(msg).__name__)
            return
        if self.quiesced and not (
            self.role is Role.LEADER and isinstance(msg, RaftHeartbeatResponse) and not msg.ctx
        ):
            # A late answer to a heartbeat from before the leader went quiet asks for
            # nothing; anything else does.
            self._wake(notify=False)
        if msg.term > self.term:
            if not self._step_higher_term(msg):
                return
        elif msg.term < self.term:
            self._step_lower_term(msg)
            return
        if isinstance(msg, RaftVote):
            self._handle_vote(msg)
        elif self.role is Role.LEADER:
            self._step_leader(msg)
        elif self.role is Role.FOLLOWER:
            self._step_follower(msg)
        else:
            self._step_candidate(msg)

    # --- output -------------------------------------------------------------------

    def ready(self) -> Ready | None:
        """The work to do now, or ``None``; see :class:`Ready` for the order of doing it."""
        self._check_input()
        if self.role is Role.LEADER:
            self._flush_appends()
        hard = HardState(self.term, self.vote, self.log.committed)
        rd = Ready(
            hard_state=hard if hard != self._prev_hard else None,
            entries=self.log.unstable_entries(),
            snapshot=self._unstable_snapshot,
            messages=self._msgs,
            committed_entries=self.log.next_committed(),
            read_states=self._read_states,
        )
        if not (
            rd.hard_state
            or rd.entries
            or rd.snapshot
            or rd.messages
            or rd.committed_entries
            or rd.read_states
        ):
            return None
        self._msgs, self._read_states = [], []
        self._outstanding = rd
        return rd

    def advance(self, rd: Ready) -> None:
        """``rd`` was persisted, sent and applied: account for it."""
        if rd is not self._outstanding:
            raise ReplicationError("advance() with a Ready that is not the outstanding one")
        self._outstanding = None
        if rd.hard_state is not None:
            self._prev_hard = rd.hard_state
        if rd.snapshot is not None and rd.snapshot is self._unstable_snapshot:
            self._unstable_snapshot = None
        if rd.entries:
            self.log.stable_to(rd.entries[-1].index, rd.entries[-1].term)
        for entry in rd.committed_entries:
            if entry.kind == "conf":
                self._apply_conf(entry)
        if rd.committed_entries:
            self.log.applied_to(rd.committed_entries[-1].index)

    # --- role changes ---------------------------------------------------------------

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term, self.vote = term, None
        self.leader_id = None
        self._election_elapsed = self._heartbeat_elapsed = 0
        self._randomized_timeout = self.config.election_ticks + self._rng.randrange(
            self.config.election_ticks
        )
        self.transferee = None
        self._votes = {}
        self.progress = {}
        self._nudge = set()
        self._read_only.clear()
        self._reads_before_commit = []
        self._conf_committed = False
        self._leaving_at = None
        self._informed = set()
        self.quiesced = False
        self._quiet_ticks = 0
        self._lease_lost = False

    def _become_follower(self, term: int, leader: int | None) -> None:
        self._reset(term)
        self.role = Role.FOLLOWER
        self.leader_id = leader

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.role = Role.LEADER
        self.leader_id = self.id
        last = self.log.last_index()
        for member in (*self.conf.voters, *self.conf.learners):
            self.progress[member] = self._new_progress(member, last + 1)
        self.progress.setdefault(self.id, self._new_progress(self.id, last + 1))
        self.progress[self.id].match = last
        # a new leader commits an entry of its own term before it changes membership
        # (Ongaro's fix for one-server changes) or answers reads
        self._pending_conf_index = self._append("noop", b"")
        log.info("node %d: leader for term %d", self.id, self.term)

    def _new_progress(self, member: int, next_index: int) -> Progress:
        return Progress(next_index, self.config.max_inflight, learner=member in self.conf.learners)

    def _campaign(self, *, transfer: bool, gone: int | None = None) -> None:
        if self.config.pre_vote and not transfer:
            # a pre-vote round: ask at term + 1 without taking it, so a node that
            # cannot win (partitioned, stale log) never raises anyone's term
            self.role, self.leader_id, self._votes = Role.PRE_CANDIDATE, None, {}
        else:
            self._become_candidate()
        self._request_votes(transfer=transfer, gone=gone)

    def _become_candidate(self) -> None:
        self._reset(self.term + 1)
        self.role, self.vote = Role.CANDIDATE, self.id

    def _request_votes(self, *, transfer: bool, gone: int | None = None) -> None:
        role = self.role
        self._record_vote(self.id, True)
        if self.role is not role:
            return  # a single-voter group decided at once
        pre_vote = role is Role.PRE_CANDIDATE
        term = self.term + 1 if pre_vote else self.term
        last_index, last_term = self.log.last_index(), self.log.last_term()
        for voter in self.conf.voters:
            if voter != self.id:
                self._send(
                    RaftVote(
                        self.id,
                        voter,
                        term,
                        last_index=last_index,
                        last_term=last_term,
                        pre_vote=pre_vote,
                        transfer=transfer,
                        gone=gone,
                    )
                )

    def _record_vote(self, voter: int, granted: bool) -> None:
        self._votes[voter] = granted
        result = vote_result(self.conf.voters, self._votes)
        if result is VoteResult.LOST:
            self._become_follower(self.term, None)
        elif result is VoteResult.WON and self.role is Role.PRE_CANDIDATE:
            self._become_candidate()
            self._request_votes(transfer=False)
        elif result is VoteResult.WON:
            self._become_leader()

    # --- term rules -----------------------------------------------------------------

    def _step_higher_term(self, msg: RaftPeerMessages) -> bool:
        """Apply the rules for a message from a later term; False means drop it."""
        if isinstance(msg, RaftVote):
            in_lease = (
                self.config.check_quorum
                and self.leader_id is not None
                and self._election_elapsed < self.config.election_ticks
                and not self._lease_lost
            )
            if in_lease and not msg.transfer:
                # a live leader is known: this candidate cannot win, do not let it disrupt
                return False
            if msg.pre_vote:
                return True  # a pre-vote never changes our term
        if isinstance(msg, RaftVoteResponse) and msg.pre_vote and msg.granted:
            return True  # granted pre-votes carry the term the candidate would take
        leader = msg.src if isinstance(msg, _FROM_LEADER) else None
        self._become_follower(msg.term, leader)
        return True

    def _step_lower_term(self, msg: RaftPeerMessages) -> None:
        if isinstance(msg, RaftAppend | RaftHeartbeat) and (
            self.config.check_quorum or self.config.pre_vote
        ):
            # a stale leader cut off by pre-vote/check-quorum would otherwise never
            # learn the newer term: tell it
            self._send(RaftAppendResponse(self.id, msg.src, self.term, index=0))
        elif isinstance(msg, RaftVote) and msg.pre_vote:
            self._send(RaftVoteResponse(self.id, msg.src, self.term, granted=False, pre_vote=True))

    def _handle_vote(self, msg: RaftVote) -> None:
        can_vote = (
            self.vote == msg.src
            or (self.vote is None and self.leader_id is None)
            or (msg.pre_vote and msg.term > self.term)
        )
        if can_vote and self.log.is_up_to_date(msg.last_index, msg.last_term):
            self._send(
                RaftVoteResponse(self.id, msg.src, msg.term, granted=True, pre_vote=msg.pre_vote)
            )
            if not msg.pre_vote:
                self.vote = msg.src
                self._election_elapsed = 0
        else:
            self._send(
                RaftVoteResponse(self.id, msg.src, self.term, granted=False, pre_vote=msg.pre_vote)
            )
            if can_vote and msg.gone is not None:
                self._succeed_instead(msg)

    def _succeed_instead(self, msg: RaftVote) -> None:
        """A candidate for dead leader ``msg.gone`` was refused for its log, behind this
        node's: campaign for that leader now, if the refusal leaves the candidate no way to
        win (the others but the dead leader are no majority, as for any survivor of three).

        Else the survivor whose log is behind would only lose, and the group wait out an
        election timeout for a leader, although the leader's death is proven. Where the
        candidate could still win elsewhere, this node does not run against it: it would
        depose a leader just elected. Votes follow the usual rules, so a node more up to
        date than this one refuses in turn and campaigns itself; each step goes to a more
        recent log, so it ends.
        """
        others = set(self.conf.voters) - {self.id, msg.gone}
        if not self.promotable() or has_quorum(self.conf.voters, others):
            return
        log.info(
            "node %d: candidate %d for dead leader %d is behind, campaigning at once",
            self.id,
            msg.src,
            msg.gone,
        )
        self._campaign(transfer=True, gone=msg.gone)

    # --- follower and candidate -----------------------------------------------------

    def _step_candidate(self, msg: RaftPeerMessages) -> None:
        if isinstance(msg, _FROM_LEADER):
            self._become_follower(self.term, msg.src)
            self._step_follower(msg)
        elif isinstance(msg, RaftVoteResponse) and msg.pre_vote == (
            self.role is Role.PRE_CANDIDATE
        ):
            self._record_vote(msg.src, msg.granted)

    def _step_follower(self, msg: RaftPeerMessages) -> None:
        if isinstance(msg, _FROM_LEADER):
            self._election_elapsed = 0
            self.leader_id = msg.src
            self._lease_lost = False
        if isinstance(msg, RaftAppend):
            self._handle_append(msg)
        elif isinstance(msg, RaftHeartbeat):
            self.log.commit_to(msg.commit)
            if msg.quiesce:
                self._follow_quiesce(msg)
                return
            self._send(
                RaftHeartbeatResponse(
                    self.id, msg.src, self.term, ctx=msg.ctx, commit=self.log.committed
                )
            )
        elif isinstance(msg, RaftSnapshotChunk):
            self._handle_chunk(msg)
        elif isinstance(msg, RaftTimeoutNow):
            if self.promotable():
                log.info("node %d: leadership transfer from %d", self.id, msg.src)
                self._campaign(transfer=True)
        elif isinstance(msg, RaftReadIndexResponse):
            self._read_states.append(ReadState(msg.index, msg.ctx))

    def _follow_quiesce(self, msg: RaftHeartbeat) -> None:
        """Go quiet with the leader if this node holds exactly the leader's committed log."""
        if self.log.committed == msg.commit == self.log.last_index():
            self.quiesced = True
        else:
            # quiet, it would never learn the entries it lacks (or lose the extra ones)
            self._send(RaftWake(self.id, msg.src, self.term))

    def _handle_append(self, msg: RaftAppend) -> None:
        if msg.prev_index < self.log.committed:
            self._send(RaftAppendResponse(self.id, msg.src, self.term, index=self.log.committed))
            return
        try:
            last_new = self.log.maybe_append(msg.prev_index, msg.prev_term, msg.commit, msg.entries)
        except ReplicationError:
            log.exception("node %d: refused append from %d", self.id, msg.src)
            return
        if last_new is not None:
            self._send(RaftAppendResponse(self.id, msg.src, self.term, index=last_new))
            return
        hint = self.log.find_conflict_by_term(msg.prev_index, msg.prev_term)
        self._send(
            RaftAppendResponse(
                self.id,
                msg.src,
                self.term,
                index=msg.prev_index,
                reject=True,
                hint_index=hint,
                hint_term=self.log.term(hint) or 0,
            )
        )

    def _handle_chunk(self, msg: RaftSnapshotChunk) -> None:
        meta = msg.meta
        if meta.index <= self.log.committed:
            # we already hold all of it; let the leader resume appends from here
            self._send(RaftAppendResponse(self.id, msg.src, self.term, index=self.log.committed))
            return
        if self._incoming is None or self._incoming[0] != meta:
            if msg.offset != 0:
                self._send(RaftSnapshotResponse(self.id, msg.src, self.term, meta.index, 0))
                return
            self._incoming = (meta, bytearray())
        buffer = self._incoming[1]
        if msg.offset == len(buffer):
            buffer.extend(msg.data)
            if msg.done:
                self._incoming = None
                self._restore(Snapshot(meta, bytes(buffer)))
                self._send(
                    RaftAppendResponse(self.id, msg.src, self.term, index=self.log.last_index())
                )
                return
        # a duplicate or out-of-order chunk gets the offset we need next
        self._send(RaftSnapshotResponse(self.id, msg.src, self.term, meta.index, len(buffer)))

    def _restore(self, snap: Snapshot) -> None:
        log.info("node %d: installing snapshot at %d", self.id, snap.meta.index)
        self.log.restore(snap.meta.index, snap.meta.term)
        self.conf = snap.meta.conf
        self._conf_history = [(snap.meta.index, snap.meta.conf)]
        self._snapshot = self._unstable_snapshot = snap

    # --- leader ---------------------------------------------------------------------

    def _tick_leader(self) -> None:
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self.config.election_ticks:
            self._election_elapsed = 0
            if self.config.check_quorum and not self._quorum_active():
                log.warning("node %d: lost contact with a quorum, stepping down", self.id)
                self._become_follower(self.term, None)
                return
            self.transferee = None
        quiet = self._count_quiet_tick()
        if self._heartbeat_elapsed >= self.config.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            if quiet:
                self._quiesce()
            else:
                self._heartbeat_round(self._read_only.last_ctx())

    def _count_quiet_tick(self) -> bool:
        """Whether the group has been quiet, at the same last index, for ``quiesce_ticks``."""
        if not self.config.quiesce_ticks or not self._group_quiet():
            self._quiet_ticks = 0
            return False
        last = self.log.last_index()
        if last != self._quiet_index:
            self._quiet_index, self._quiet_ticks = last, 0
        self._quiet_ticks += 1
        return self._quiet_ticks >= self.config.quiesce_ticks

    def _group_quiet(self) -> bool:
        """Nothing in flight: all committed and applied, every member holds the whole log,
        no read, transfer, membership change or hand-over pending."""
        last = self.log.last_index()
        return (
            self.log.committed == last
            and self.log.applied == last
            and self.transferee is None
            and self._leaving_at is None
            and not self._read_only
            and not self._reads_before_commit
            and all(
                pr.match == last and pr.state is ProgressState.REPLICATE
                for member, pr in self.progress.items()
                if member != self.id
            )
        )

    def _quiesce(self) -> None:
        """Tell every member to stop timing this leader, and stop heartbeating."""
        log.debug("node %d: quiescing the group at %d", self.id, self.log.committed)
        commit = self.log.committed
        for member in self.progress:
            if member != self.id:
                self._send(RaftHeartbeat(self.id, member, self.term, commit=commit, quiesce=True))
        self.quiesced = True

    def _wake(self, *, notify: bool) -> None:
        self.quiesced = False
        self._quiet_ticks = 0
        self._election_elapsed = 0
        if self.role is Role.LEADER:
            self._heartbeat_elapsed = 0
            for pr in self.progress.values():
                pr.recent_active = False  # check-quorum counts answers from now on
            self._broadcast_heartbeat(b"")
            return
        self._lease_lost = True
        if notify and self.leader_id is not None:
            self._send(RaftWake(self.id, self.leader_id, self.term))

    def _quorum_active(self) -> bool:
        active = {self.id}
        for member, pr in self.progress.items():
            if pr.recent_active:
                active.add(member)
            pr.recent_active = False
        return has_quorum(self.conf.voters, active)

    def _step_leader(self, msg: RaftPeerMessages) -> None:
        if isinstance(msg, RaftReadIndex):
            self._leader_read(msg.ctx, msg.src)
            return
        pr = self.progress.get(msg.src)
        if pr is None:
            return
        if isinstance(
            msg, RaftAppendResponse | RaftHeartbeatResponse | RaftSnapshotResponse | RaftWake
        ):
            pr.recent_active = True
        if isinstance(msg, RaftAppendResponse):
            self._on_append_response(msg, pr)
        elif isinstance(msg, RaftHeartbeatResponse):
            pr.probe_sent = False
            if pr.state is ProgressState.REPLICATE and pr.inflights.full():
                pr.inflights.free_first()  # lets a lost append be detected by the next one
            if pr.state is ProgressState.SNAPSHOT:
                self._send_chunk(msg.src, pr)
            elif pr.match < self.log.last_index():
                # appends may have been lost with nothing left to send: an empty one
                # at `next` gets rejected if so, and the rejection starts a probe
                self._nudge.add(msg.src)
            if self._leaving_at is not None:
                self._on_leaving_ack(msg.src, msg.commit)
            elif msg.ctx:
                for ctx, index, origin in self._read_only.ack(msg.ctx, msg.src, self.conf.voters):
                    self._answer_read(ctx, index, origin)
        elif isinstance(msg, RaftSnapshotResponse) and pr.state is ProgressState.SNAPSHOT:
            if msg.snapshot_index == pr.pending_snapshot:
                pr.snapshot_offset = msg.offset
            self._send_chunk(msg.src, pr)
        elif isinstance(msg, RaftAppend | RaftHeartbeat | RaftSnapshotChunk):
            log.error("node %d: another leader %d in term %d", self.id, msg.src, self.term)

    def _on_append_response(self, msg: RaftAppendResponse, pr: Progress) -> None:
        if msg.reject:
            probe = msg.hint_index
            if msg.hint_term > 0:
                probe = self.log.find_conflict_by_term(msg.hint_index, msg.hint_term)
            if pr.maybe_decrease(msg.index, probe) and pr.state is ProgressState.REPLICATE:
                pr.become_probe()
            return
        same_probe = pr.state is ProgressState.PROBE and pr.match == msg.index
        if not pr.maybe_update(msg.index) and not same_probe:
            return
        if pr.state is ProgressState.PROBE or (
            pr.state is ProgressState.SNAPSHOT and pr.match >= pr.pending_snapshot
        ):
            pr.become_replicate()
        else:
            pr.inflights.free_to(msg.index)
        self._maybe_commit()
        if msg.src == self.transferee and pr.match == self.log.last_index():
            self._send(RaftTimeoutNow(self.id, msg.src, self.term))

    def _append(self, kind: EntryKind, data: bytes) -> int:
        index = self.log.last_index() + 1
        entry = Entry(term=self.term, index=index, kind=kind, data=data)
        self.log.append([entry])
        self.progress[self.id].match = index
        self._maybe_commit()
        return index

    def _maybe_commit(self) -> None:
        match = {member: pr.match for member, pr in self.progress.items()}
        before = self.log.committed
        if not self.log.maybe_commit(committed_index(self.conf.voters, match), self.term):
            return
        if any(e.kind == "conf" for e in self.log.slice(before + 1, self.log.committed + 1)):
            # A removed member hears nothing once the change applies: tell it now.
            self._conf_committed = True
        if self._reads_before_commit:
            waiting, self._reads_before_commit = self._reads_before_commit, []
            for ctx, origin in waiting:
                self._leader_read(ctx, origin)

    def _flush_appends(self) -> None:
        """Send whatever each follower can take now.

        A new commit index alone is no reason to send, unless it commits a membership
        change: followers learn it from the next append or heartbeat (at most
        ``2 * heartbeat_ticks`` later: :meth:`_heartbeat_round`), as in Raft's paper.
        Each round then costs every follower one message and one answer, not two of each.
        """
        for member, pr in self.progress.items():
            if member == self.id:
                continue
            send_empty = self._conf_committed or member in self._nudge
            while self._send_append(member, pr, send_empty=send_empty):
                send_empty = False
        self._conf_committed = False
        self._nudge.clear()

    def _send_append(self, to: int, pr: Progress, *, send_empty: bool) -> bool:
        if pr.paused():
            return False
        prev = pr.next - 1
        prev_term = self.log.term(prev)
        if prev_term is None:
            if prev > self.log.last_index():
                pr.next = self.log.last_index() + 1
                return True
            pr.become_snapshot(self._snapshot.meta.index)
            self._send_chunk(to, pr)
            return False
        last = self.log.last_index()
        entries = self.log.slice(pr.next, last + 1, self.config.max_batch_bytes)
        if not entries and not send_empty:
            return False
        self._send(
            RaftAppend(
                self.id,
                to,
                self.term,
                prev_index=prev,
                prev_term=prev_term,
                commit=self.log.committed,
                entries=entries,
            )
        )
        pr.sent_append(entries[-1].index if entries else prev, len(entries))
        return bool(entries) and pr.state is ProgressState.REPLICATE

    def _send_chunk(self, to: int, pr: Progress) -> None:
        snap = self._snapshot
        if pr.pending_snapshot != snap.meta.index:
            pr.become_snapshot(snap.meta.index)
        start = pr.snapshot_offset
        chunk = snap.data[start : start + self.config.snapshot_chunk_bytes]
        self._send(
            RaftSnapshotChunk(
                self.id,
                to,
                self.term,
                meta=snap.meta,
                offset=start,
                data=chunk,
                done=start + len(chunk) >= len(snap.data),
            )
        )

    def _broadcast_heartbeat(self, ctx: bytes) -> None:
        for member, pr in self.progress.items():
            if member != self.id:
                self._send_heartbeat(member, pr, ctx)

    def _heartbeat_round(self, ctx: bytes) -> None:
        """The periodic heartbeat: every member that no append reached since the last
        round gets one.

        While proposals come (a kernel's cells), each follower gets an append per
        proposal, which resets its election timer and carries the commit index as a
        heartbeat does; a heartbeat besides costs it, and the leader, a message and an
        answer each. A follower
        then hears from the leader at least every ``2 * heartbeat_ticks``, so this holds
        only while that is below ``election_ticks``. A round carrying a read's context
        (a read waits for a quorum's answers to it) or a leaving leader's (it waits for
        their commit index) goes to every member.
        """
        skip_appended = (
            not ctx
            and self._leaving_at is None
            and 2 * self.config.heartbeat_ticks < self.config.election_ticks
        )
        for member, pr in self.progress.items():
            if member != self.id and not (skip_appended and pr.appended):
                self._send_heartbeat(member, pr, ctx)
            pr.appended = False

    def _send_heartbeat(self, member: int, pr: Progress, ctx: bytes) -> None:
        commit = min(pr.match, self.log.committed)
        self._send(RaftHeartbeat(self.id, member, self.term, commit=commit, ctx=ctx))

    def _leader_read(self, ctx: bytes, origin: int | None) -> None:
        if self.log.term(self.log.committed) != self.term:
            # until it commits in its term a new leader does not know the true commit index
            self._reads_before_commit.append((ctx, origin))
        elif has_quorum(self.conf.voters, {self.id}):
            self._answer_read(ctx, self.log.committed, origin)
        else:
            self._read_only.add(ctx, self.log.committed, origin, self.id)
            self._broadcast_heartbeat(ctx)

    def _answer_read(self, ctx: bytes, index: int, origin: int | None) -> None:
        if origin is None:
            self._read_states.append(ReadState(index, ctx))
        else:
            self._send(RaftReadIndexResponse(self.id, origin, self.term, ctx=ctx, index=index))

    # --- membership -----------------------------------------------------------------

    def _apply_conf(self, entry: Entry) -> None:
        try:
            self.conf = apply_change(self.conf, decode_change(entry.data))
        except (DecodeError, MembershipChangeError) as exc:
            # every node skips the same entry: apply is deterministic
            log.warning("node %d: skipping conf entry %d: %s", self.id, entry.index, exc)
            return
        self._conf_history.append((entry.index, self.conf))
        if self.role is Role.LEADER:
            self._sync_progress(entry.index)

    def _sync_progress(self, index: int) -> None:
        members = {*self.conf.voters, *self.conf.learners}
        for gone in set(self.progress) - members - {self.id}:
            del self.progress[gone]
        for member in members:
            pr = self.progress.setdefault(
                member, self._new_progress(member, self.log.last_index() + 1)
            )
            pr.learner = member in self.conf.learners
        if self.id not in self.conf.voters and self._leaving_at is None:
            # Removed: keep leading (without counting ourselves) until a quorum of the
            # new voters knows the change is committed. They act on it when they apply
            # it; had we left at once, they could be stuck electing under the old
            # membership, which needs our vote.
            log.info("node %d: removed from the voters, handing over", self.id)
            self._leaving_at = index
            self._read_only.clear()
            self._reads_before_commit = []
            self._broadcast_heartbeat(b"")
        self._maybe_commit()

    def _on_leaving_ack(self, member: int, commit: int) -> None:
        assert self._leaving_at is not None
        if commit >= self._leaving_at:
            self._informed.add(member)
        if not has_quorum(self.conf.voters, self._informed):
            return
        best = max(self._informed & set(self.conf.voters), key=lambda v: self.progress[v].match)
        if self.progress[best].match == self.log.last_index():
            # spare the group an election timeout
            self._send(RaftTimeoutNow(self.id, best, self.term))
        log.info("node %d: new voters know of the removal, stepping down", self.id)
        self._become_follower(self.term, None)

    def _conf_at(self, index: int) -> ConfState:
        conf = self._conf_history[0][1]
        for at, state in self._conf_history:
            if at <= index:
                conf = state
        return conf

    # --- helpers --------------------------------------------------------------------

    def _send(self, msg: RaftPeerMessages) -> None:
        self._msgs.append(msg)

    def _check_input(self) -> None:
        if self._outstanding is not None:
            raise ReplicationError("input between ready() and advance()")

    def _check_leader(self) -> None:
        self._check_input()
        if self.role is not Role.LEADER:
            raise NotLeaderError(self.leader_id)
        if self.transferee is not None:
            raise NotLeaderError(self.transferee)
        if self._leaving_at is not None:
            raise NotLeaderError(None)
