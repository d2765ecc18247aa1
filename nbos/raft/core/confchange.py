"""Membership changes, one server at a time, and cluster bootstrap.

A :class:`~nbos.core.wire.raft.ConfChange` travels in a ``kind="conf"`` log
entry and takes effect on each node when that entry is **applied** (see
``docs/raft.md`` for why this is safe with one change at a time).
"""

from __future__ import annotations

import msgspec

from nbos.core.errors import DecodeError, MembershipChangeError
from nbos.core.wire.raft import ConfChange, ConfState, Entry, HardState
from nbos.raft.core.config import StorageView

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ConfChange)


def encode_change(change: ConfChange) -> bytes:
    return _encoder.encode(change)


def decode_change(data: bytes) -> ConfChange:
    try:
        return _decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError) as exc:
        raise DecodeError(f"bad conf change payload: {exc}") from exc


def apply_change(conf: ConfState, change: ConfChange) -> ConfState:
    """The membership after ``change``; raises ``MembershipChangeError`` if it does not fit."""
    voters, learners, node = list(conf.voters), list(conf.learners), change.node
    member = node in voters or node in learners
    if change.kind in ("add_voter", "add_learner"):
        if member:
            raise MembershipChangeError(f"node {node} is already a member")
        (voters if change.kind == "add_voter" else learners).append(node)
    elif change.kind == "promote":
        if node not in learners:
            raise MembershipChangeError(f"node {node} is not a learner")
        learners.remove(node)
        voters.append(node)
    else:
        if not member:
            raise MembershipChangeError(f"node {node} is not a member")
        if voters == [node]:
            raise MembershipChangeError(f"cannot remove the last voter {node}")
        (voters if node in voters else learners).remove(node)
    return ConfState(voters=sorted(voters), learners=sorted(learners))


def bootstrap(voters: list[int]) -> StorageView:
    """The initial durable state of every founding member of a new group.

    The founding membership is written as committed conf entries at term 1,
    identical on every founder, so a member added later learns it from the log
    like any other change.
    """
    if not voters or len(set(voters)) != len(voters):
        raise MembershipChangeError(f"bootstrap needs distinct voters, got {voters}")
    entries = tuple(
        Entry(term=1, index=i, kind="conf", data=encode_change(ConfChange("add_voter", node)))
        for i, node in enumerate(voters, start=1)
    )
    return StorageView(hard_state=HardState(term=1, commit=len(entries)), entries=entries)
