"""Raft log records and peer messages.

The records (``Entry``, ``HardState``, ``ConfState``, ``SnapshotMeta``) are what
the durable log store persists; the messages are what Raft peers exchange.
"""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message

EntryKind = Literal["normal", "conf", "noop"]


class Entry(Message):
    """One log entry. ``kind="conf"`` entries carry an encoded membership change."""

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


RaftRecord = Entry | HardState | ConfState | SnapshotMeta
RaftMessage = RaftRecord
