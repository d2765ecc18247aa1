"""Raft peer messages."""

from __future__ import annotations

from nbos.core.wire.base import Message


class RequestVote(Message):
    """Placeholder until the Raft core defines its messages."""

    term: int


RaftMessage = RequestVote
