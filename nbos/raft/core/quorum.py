"""Majority arithmetic over the voters of one configuration."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping


class VoteResult(enum.Enum):
    PENDING = "pending"
    WON = "won"
    LOST = "lost"


def majority(voters: Collection[int]) -> int:
    """Votes needed for a quorum of ``voters``."""
    return len(voters) // 2 + 1


def committed_index(voters: Collection[int], match: Mapping[int, int]) -> int:
    """The largest index held by a quorum of ``voters`` (0 for no voters)."""
    if not voters:
        return 0
    indexes = sorted((match.get(v, 0) for v in voters), reverse=True)
    return indexes[majority(voters) - 1]


def vote_result(voters: Collection[int], votes: Mapping[int, bool]) -> VoteResult:
    """Whether ``votes`` (voter -> granted) already decide an election."""
    granted = sum(1 for v in voters if votes.get(v) is True)
    rejected = sum(1 for v in voters if votes.get(v) is False)
    need = majority(voters)
    if granted >= need:
        return VoteResult.WON
    if len(voters) - rejected < need:
        return VoteResult.LOST
    return VoteResult.PENDING


def has_quorum(voters: Collection[int], alive: Collection[int]) -> bool:
    """Whether ``alive`` contains a quorum of ``voters``."""
    return sum(1 for v in voters if v in alive) >= majority(voters)
