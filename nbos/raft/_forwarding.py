"""Proposal forwarding: ``propose(..., forward=True)`` on any member, as in etcd-io/raft.

A follower sends the proposal to the leader it knows of in a
:class:`~nbos.core.wire.raft.RaftForward` over the Raft transport, and hands it over
again as soon as the leader (or the term) changes, or when nothing applied within an
election timeout. The client session makes each hand-over idempotent, and the callers' wait
ends when the entry with the proposal's ``(client_id, seq)`` applies on this node.
"""

from __future__ import annotations

import logging

import msgspec

from nbos.core.errors import NotLeaderError
from nbos.core.wire.log_commands import ClientSession, Proposal
from nbos.core.wire.raft import RaftForward
from nbos.raft._client_sessions import ClientSessions
from nbos.raft._waiters import PendingProposal
from nbos.raft.core import RaftNode

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()


class ForwardedProposal:
    """A ``forward=True`` proposal not applied here yet, and whom it was last handed to."""

    def __init__(self, proposal: Proposal, pending: PendingProposal) -> None:
        self.proposal = proposal
        self.payload = _encoder.encode(proposal)
        #: Callers of ``propose`` waiting on it (a retry with the same session joins).
        self.waiters = [pending]
        #: ``(term, leader)`` when it was last handed over; it is handed over again when
        #: that changes, or at tick ``retry_at`` (``None``: this leader appended it, and
        #: it stays in the log for as long as the term lasts).
        self.via: tuple[int, int | None] = (-1, None)
        self.retry_at: int | None = 0

    @property
    def done(self) -> bool:
        return all(w.outcome.done for w in self.waiters)

    def settle(self, result: bytes) -> None:
        for waiter in self.waiters:
            waiter.outcome.set(result)


class Forwarding:
    """This member's forwarded proposals until they apply here, and the leader's side:
    appending what followers forwarded. Used on the node loop only."""

    def __init__(self, node: RaftNode, sessions: ClientSessions, election_ticks: int) -> None:
        self._node = node
        self._sessions = sessions
        self._election_ticks = election_ticks
        #: By ``(client_id, seq)``; the driver looks here whether any is in flight.
        self.tracked: dict[tuple[str, int], ForwardedProposal] = {}
        #: Proposals to send per leader, until :meth:`messages` takes them: the node loop
        #: sends them after it took its queued input, one message per leader.
        self.unsent: dict[int, list[Proposal]] = {}
        self._ticks = 0

    def track(self, proposal: Proposal, pending: PendingProposal) -> None:
        """Start handing ``proposal`` to the leader until it applies here."""
        if self._settle_from_session(proposal, [pending]):
            return
        key = (proposal.client_id, proposal.seq)
        tracked = self.tracked.get(key)
        if tracked is not None:  # the same proposal again: it waits with the first
            tracked.waiters.append(pending)
            return
        tracked = self.tracked[key] = ForwardedProposal(proposal, pending)
        self._hand_over(tracked)

    def tick(self) -> None:
        self._ticks += 1
        if self.tracked:
            self._retry()

    def follow_leader(self) -> None:
        """Hand over at once what was handed to another leader or term than the current
        one: a proposal made while no leader was known (a settle sent to a survivor as it
        campaigns for a dead leader) goes out as the leader is known, or is appended with
        this node's first entry as the new leader, not a tick later."""
        node = self._node
        now = (node.term, node.leader_id)
        for tracked in list(self.tracked.values()):
            if tracked.via != now and not tracked.done:
                self._hand_over(tracked)

    def settle(self, session: ClientSession) -> None:
        """Settle the proposal that applied as ``session``, if it is one of these."""
        tracked = self.tracked.pop((session.client_id, session.seq), None)
        if tracked is not None:
            tracked.settle(session.result)

    def settle_restored(self) -> None:
        """Settle what a snapshot just restored covers: it applied here without an entry."""
        for key, tracked in list(self.tracked.items()):
            if self._settle_from_session(tracked.proposal, tracked.waiters):
                del self.tracked[key]

    def take(self, message: RaftForward) -> None:
        """As the leader, append proposals a follower forwarded (dropped otherwise)."""
        for proposal in message.proposals:
            if self._sessions.result(proposal.client_id, proposal.seq) is not None:
                continue  # applied already: its proposer learns the result applying it
            try:
                self._node.propose(_encoder.encode(proposal))
            except NotLeaderError as exc:
                # the follower hands them over again once it knows the new leader
                log.debug("node %d: forwarded proposals dropped: %s", self._node.id, exc)
                return

    def messages(self) -> list[RaftForward]:
        """The :attr:`unsent` proposals, one message per leader; they count as sent."""
        node = self._node
        unsent, self.unsent = self.unsent, {}
        return [
            RaftForward(node.id, leader, node.term, proposals=proposals)
            for leader, proposals in unsent.items()
        ]

    def clear(self) -> None:
        """Forget every tracked proposal (the log closed, and failed their callers)."""
        self.tracked.clear()

    def _hand_over(self, tracked: ForwardedProposal) -> None:
        """Append ``tracked`` as the leader, or send it to the leader this node knows of."""
        node = self._node
        tracked.via = (node.term, node.leader_id)
        try:
            node.propose(tracked.payload)  # a follower refuses, but wakes to time the leader
        except NotLeaderError:
            if node.leader_id is None or node.leader_id == node.id:
                # No leader known, or this one refuses for now (a leadership transfer,
                # its own removal): try again on the next tick.
                tracked.retry_at = self._ticks + 1
            else:
                self.unsent.setdefault(node.leader_id, []).append(tracked.proposal)
                # lost on the way, or dropped by a leader in transfer: sent again later
                tracked.retry_at = self._ticks + self._election_ticks
        else:
            tracked.retry_at = None

    def _retry(self) -> None:
        """Hand over again what a leader change (or a lost message) may have dropped."""
        node = self._node
        now = (node.term, node.leader_id)
        for key, tracked in list(self.tracked.items()):
            if tracked.done:  # its callers' deadlines passed
                del self.tracked[key]
            elif tracked.via != now or (
                tracked.retry_at is not None and self._ticks >= tracked.retry_at
            ):
                self._hand_over(tracked)

    def _settle_from_session(self, proposal: Proposal, waiters: list[PendingProposal]) -> bool:
        """Settle ``waiters`` if ``proposal``'s session shows it applied already."""
        result = self._sessions.result(proposal.client_id, proposal.seq)
        if result is None:
            return False
        for waiter in waiters:
            waiter.outcome.set(result)
        return True
