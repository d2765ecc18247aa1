"""Raft log records and peer messages.

The records (``Entry``, ``HardState``, ``ConfState``, ``SnapshotMeta``,
``ConfChange``) are what the durable log store persists; the messages are what
Raft peers exchange. Every peer message carries ``src`` (sender node id),
``dst`` (receiver node id) and ``term`` (the sender's term, or for a granted
pre-vote the term the candidate would take). Their class names are wire tags,
so they all start with ``Raft`` to stay unique across nbos.
"""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message
from nbos.core.wire.log_commands import Proposal

EntryKind = Literal["normal", "conf", "noop"]
ConfChangeKind = Literal["add_voter", "add_learner", "promote", "remove"]


class Entry(Message):
    """One log entry. ``kind="conf"`` entries carry an encoded :class:`ConfChange`."""

    term: int
    index: int
    kind: EntryKind = "normal"
    data: bytes = b""


class HardState(Message):
    """What must be durable before a node answers a vote or an append: term, vote, commit."""

    term: int = 0
    vote: int | None = None
    commit: int = 0


class ConfState(Message):
    """Membership: the voters and the non-voting learners."""

    voters: list[int]
    learners: list[int] = []


class SnapshotMeta(Message):
    """The log position and membership a snapshot image stands for."""

    index: int
    term: int
    conf: ConfState


class ConfChange(Message):
    """One membership change: the payload of a ``kind="conf"`` entry."""

    kind: ConfChangeKind
    node: int


RaftRecord = Entry | HardState | ConfState | SnapshotMeta | ConfChange


# --- peer messages ---------------------------------------------------------------


class RaftPeerMessage(Message):
    """Fields every Raft peer message has (not itself on the wire)."""

    src: int
    dst: int
    term: int


class RaftVote(RaftPeerMessage):
    """A (pre-)vote request. ``transfer`` marks a leadership transfer, which breaks leases;
    ``gone`` the leader whose process ended, when the candidate campaigns for it."""

    last_index: int
    last_term: int
    pre_vote: bool = False
    transfer: bool = False
    gone: int | None = None


class RaftVoteResponse(RaftPeerMessage):
    """Answer to :class:`RaftVote`; ``pre_vote`` echoes the request's kind."""

    granted: bool
    pre_vote: bool = False


class RaftAppend(RaftPeerMessage):
    """AppendEntries: ``entries`` follow ``(prev_index, prev_term)``; ``commit`` is the leader's."""

    prev_index: int
    prev_term: int
    commit: int
    entries: list[Entry] = []


class RaftAppendResponse(RaftPeerMessage):
    """Answer to :class:`RaftAppend` (also sent after a snapshot is installed).

    On success ``index`` is the follower's last index known to match the leader.
    On ``reject``, ``index`` is the rejected ``prev_index`` and ``(hint_index,
    hint_term)`` is the follower's last entry at or below it whose term is at
    most the rejected ``prev_term``, so the leader skips a whole term per round.
    """

    index: int
    reject: bool = False
    hint_index: int = 0
    hint_term: int = 0


class RaftHeartbeat(RaftPeerMessage):
    """Leader liveness; ``commit`` never exceeds what the receiver is known to hold.

    ``quiesce``: the group is idle and the receiver holds the whole log; it stops its
    election timer (no answer) or, if its log is not the leader's, answers with
    :class:`RaftWake`.
    """

    commit: int
    ctx: bytes = b""
    quiesce: bool = False


class RaftHeartbeatResponse(RaftPeerMessage):
    """Answer to :class:`RaftHeartbeat`; echoes ``ctx`` (a ReadIndex round).

    ``commit`` is the responder's commit index, which a leader that removed itself
    waits on before it hands over (see ``docs/raft.md``).
    """

    ctx: bytes = b""
    commit: int = 0


class RaftSnapshotChunk(RaftPeerMessage):
    """InstallSnapshot: bytes ``[offset, offset + len(data))`` of the image for ``meta``."""

    meta: SnapshotMeta
    offset: int
    data: bytes
    done: bool


class RaftSnapshotResponse(RaftPeerMessage):
    """Acknowledges chunks: the follower next expects byte ``offset`` of the image."""

    snapshot_index: int
    offset: int


class RaftTimeoutNow(RaftPeerMessage):
    """Leadership transfer: campaign now, skipping pre-vote and leases."""


class RaftWake(RaftPeerMessage):
    """A follower that woke up (or could not quiesce) asks a quiesced leader to heartbeat."""


class RaftReadIndex(RaftPeerMessage):
    """A follower asks the leader for a linearizable read index for ``ctx``."""

    ctx: bytes


class RaftReadIndexResponse(RaftPeerMessage):
    """The leader's answer to :class:`RaftReadIndex`: reads are safe once ``index`` is applied."""

    ctx: bytes
    index: int


RaftPeerMessages = (
    RaftVote
    | RaftVoteResponse
    | RaftAppend
    | RaftAppendResponse
    | RaftHeartbeat
    | RaftHeartbeatResponse
    | RaftSnapshotChunk
    | RaftSnapshotResponse
    | RaftTimeoutNow
    | RaftReadIndex
    | RaftReadIndexResponse
    | RaftWake
)


# --- driver messages: between Raft drivers, never stepped into the core ------------


class RaftForward(RaftPeerMessage):
    """A follower hands its proposals to the leader (etcd's forwarded ``MsgProp``).

    Each keeps its proposer's session ``(client_id, seq)``: a proposal forwarded again
    (a lost message, a new leader) applies once all the same.
    """

    proposals: list[Proposal]


class RaftTransferRequest(RaftPeerMessage):
    """A follower asks the leader to hand leadership to it (the sender)."""


RaftDriverMessages = RaftForward | RaftTransferRequest
RaftMessage = RaftRecord | RaftPeerMessages | RaftDriverMessages
