"""Pending ReadIndex requests on a leader, each confirmed by a heartbeat round.

A request records the commit index when it arrived; once a quorum answers a
heartbeat sent after it (carrying its ``ctx``), no other leader can have
committed anything newer, so that index is a linearizable read point. A quorum
answer to one request also confirms every request queued before it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from nbos.raft.core.quorum import has_quorum


@dataclass
class _Pending:
    ctx: bytes
    index: int
    #: who asked: this node (``None``) or the follower to answer
    origin: int | None
    acks: set[int] = field(default_factory=set)


class ReadOnlyQueue:
    """Read requests waiting for their heartbeat quorum, oldest first."""

    def __init__(self) -> None:
        self._queue: list[_Pending] = []

    def add(self, ctx: bytes, index: int, origin: int | None, self_id: int) -> None:
        if any(p.ctx == ctx for p in self._queue):
            return  # a retried request rides on the round already under way
        self._queue.append(_Pending(ctx, index, origin, {self_id}))

    def last_ctx(self) -> bytes:
        return self._queue[-1].ctx if self._queue else b""

    def ack(
        self, ctx: bytes, node: int, voters: Collection[int]
    ) -> list[tuple[bytes, int, int | None]]:
        """Record ``node``'s answer for ``ctx``; returns the requests now confirmed."""
        for n, pending in enumerate(self._queue):
            if pending.ctx == ctx:
                pending.acks.add(node)
                if not has_quorum(voters, pending.acks):
                    return []
                done, self._queue = self._queue[: n + 1], self._queue[n + 1 :]
                return [(p.ctx, p.index, p.origin) for p in done]
        return []

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)
