"""The leader's view of each follower: how far it matches and how to feed it.

A follower is in one of three states:

* ``PROBE``: the leader does not know where the logs match; it sends one
  append at a time and waits for the answer (or a heartbeat answer) before the
  next, backing ``next`` off on each rejection using the follower's hint.
* ``REPLICATE``: the logs match up to ``match``; the leader streams appends
  optimistically, up to ``max_inflight`` unacknowledged ones.
* ``SNAPSHOT``: the entries the follower needs were compacted; the leader
  sends the snapshot image in chunks, one chunk in flight at a time.
"""

from __future__ import annotations

import enum
from collections import deque


class ProgressState(enum.Enum):
    PROBE = "probe"
    REPLICATE = "replicate"
    SNAPSHOT = "snapshot"


class Inflights:
    """Last indexes of appends sent and not yet acknowledged, oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._last_indexes: deque[int] = deque()

    def add(self, last_index: int) -> None:
        self._last_indexes.append(last_index)

    def free_to(self, index: int) -> None:
        while self._last_indexes and self._last_indexes[0] <= index:
            self._last_indexes.popleft()

    def free_first(self) -> None:
        if self._last_indexes:
            self._last_indexes.popleft()

    def full(self) -> bool:
        return len(self._last_indexes) >= self.capacity

    def reset(self) -> None:
        self._last_indexes.clear()

    def __len__(self) -> int:
        return len(self._last_indexes)


class Progress:
    """Replication progress of one member, as tracked by the leader."""

    def __init__(self, next_index: int, max_inflight: int, *, learner: bool) -> None:
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.learner = learner
        #: in PROBE: an append is outstanding; cleared by any answer or a heartbeat answer
        self.probe_sent = False
        #: heard from since the last check-quorum round
        self.recent_active = False
        #: an append went to it since the leader's last heartbeat round
        self.appended = False
        self.inflights = Inflights(max_inflight)
        #: in SNAPSHOT: the snapshot index being sent and the next byte to send
        self.pending_snapshot = 0
        self.snapshot_offset = 0

    def paused(self) -> bool:
        if self.state is ProgressState.PROBE:
            return self.probe_sent
        if self.state is ProgressState.REPLICATE:
            return self.inflights.full()
        return True

    def become_probe(self) -> None:
        # after a snapshot, the follower holds at least the snapshot's index
        if self.state is ProgressState.SNAPSHOT:
            self.next = max(self.match + 1, self.pending_snapshot + 1)
        else:
            self.next = self.match + 1
        self._reset(ProgressState.PROBE)

    def become_replicate(self) -> None:
        self.next = self.match + 1
        self._reset(ProgressState.REPLICATE)

    def become_snapshot(self, snapshot_index: int) -> None:
        self._reset(ProgressState.SNAPSHOT)
        self.pending_snapshot = snapshot_index
        self.snapshot_offset = 0

    def _reset(self, state: ProgressState) -> None:
        self.state = state
        self.probe_sent = False
        self.pending_snapshot = 0
        self.snapshot_offset = 0
        self.inflights.reset()

    def sent_append(self, last_index: int, count: int) -> None:
        """Record an append carrying ``count`` entries ending at ``last_index``."""
        self.appended = True
        if self.state is ProgressState.REPLICATE:
            if count:
                self.next = last_index + 1
                self.inflights.add(last_index)
        elif self.state is ProgressState.PROBE:
            self.probe_sent = True

    def maybe_update(self, index: int) -> bool:
        """A successful answer up to ``index``; returns whether ``match`` advanced."""
        updated = index > self.match
        if updated:
            self.match = index
            self.probe_sent = False
        self.next = max(self.next, index + 1)
        return updated

    def maybe_decrease(self, rejected: int, hint: int) -> bool:
        """A rejection of an append at ``rejected``; returns False for a stale one."""
        if self.state is ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, hint + 1), self.match + 1, 1)
        self.probe_sent = False
        return True
