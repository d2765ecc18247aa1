"""The in-memory view of a log: snapshot position, entries after it, hard state.

Both stores keep their whole log in memory (kernels' logs are compacted often),
so the queries and the write rules live here once; a store validates a write
with :meth:`LogIndex.check_save`, makes it durable, then applies it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import pairwise

from nbos.core.log_storage import InitialState
from nbos.core.wire.raft import Entry, HardState, SnapshotMeta
from nbos.raft.storage._errors import (
    InvalidLogWriteError,
    LogCompactedError,
    LogUnavailableError,
    SnapshotOutOfDateError,
)

log = logging.getLogger(__name__)

# Rough per-entry overhead (msgpack tags and ints) for ``max_bytes`` accounting.
_ENTRY_OVERHEAD = 24


class LogIndex:
    """Entries ``first_index() .. last_index()`` in memory, plus the snapshot and hard state."""

    def __init__(
        self,
        hard_state: HardState | None = None,
        snapshot: SnapshotMeta | None = None,
        entries: Sequence[Entry] = (),
    ) -> None:
        self.hard_state = hard_state or HardState()
        self.snapshot = snapshot
        self._entries: list[Entry] = list(entries)

    # --- queries -----------------------------------------------------------------

    @property
    def snapshot_index(self) -> int:
        return self.snapshot.index if self.snapshot else 0

    def first_index(self) -> int:
        return self.snapshot_index + 1

    def last_index(self) -> int:
        return self.snapshot_index + len(self._entries)

    def all_entries(self) -> list[Entry]:
        return list(self._entries)

    def term(self, index: int) -> int:
        snap = self.snapshot_index
        if index == snap:
            return self.snapshot.term if self.snapshot else 0
        if index < snap:
            raise LogCompactedError(index, snap + 1)
        if index > self.last_index():
            raise LogUnavailableError(index, self.last_index())
        return self._entries[index - snap - 1].term

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        if lo <= self.snapshot_index:
            raise LogCompactedError(lo, self.first_index())
        if hi > self.last_index() + 1:
            raise LogUnavailableError(hi - 1, self.last_index())
        if lo >= hi:
            return []
        base = self.snapshot_index + 1
        picked = self._entries[lo - base : hi - base]
        return picked if max_bytes is None else _limit_size(picked, max_bytes)

    # --- writes --------------------------------------------------------------------

    def check_save(self, hard_state: HardState | None, entries: Sequence[Entry]) -> list[Entry]:
        """Validate a batch; returns the entries that are left to write (past the snapshot)."""
        if hard_state is not None:
            _check_hard_state(self.hard_state, hard_state)
        fresh = [e for e in entries if e.index > self.snapshot_index]
        if not fresh:
            return fresh
        for prev, cur in pairwise(fresh):
            if cur.index != prev.index + 1:
                raise _refused(
                    f"entries are not consecutive: index {cur.index} follows {prev.index}"
                )
            if cur.term < prev.term:
                raise _refused(
                    f"term goes back from {prev.term} to {cur.term} at index {cur.index}"
                )
        first = fresh[0]
        if first.index > self.last_index() + 1:
            raise _refused(
                f"gap: first new entry is {first.index}, the log ends at {self.last_index()}"
            )
        if first.term < self.term(first.index - 1):
            raise _refused(
                f"entry {first.index} has term {first.term}, "
                f"below the term {self.term(first.index - 1)} of the entry before it"
            )
        return fresh

    def apply_save(self, hard_state: HardState | None, fresh: Sequence[Entry]) -> None:
        """Apply a batch already checked by :meth:`check_save`."""
        if fresh:
            del self._entries[fresh[0].index - self.snapshot_index - 1 :]
            self._entries.extend(fresh)
        if hard_state is not None:
            self.hard_state = hard_state

    def check_compact(self, upto_index: int) -> None:
        """A store may drop files only up to the snapshot: later entries are the log itself."""
        if upto_index > self.snapshot_index:
            raise InvalidLogWriteError(
                f"cannot compact to {upto_index}: the snapshot is at {self.snapshot_index}"
            )

    def check_snapshot(self, meta: SnapshotMeta) -> None:
        if self.snapshot is not None and meta.index < self.snapshot.index:
            raise SnapshotOutOfDateError(meta.index, self.snapshot.index)

    def apply_snapshot(self, meta: SnapshotMeta) -> None:
        """Compact to ``meta``: keep the entries after it only if the log agrees at its index."""
        keep = self._holds(meta.index, meta.term)
        self._entries = self._entries[meta.index - self.snapshot_index :] if keep else []
        self.snapshot = meta

    def _holds(self, index: int, term: int) -> bool:
        if not self.snapshot_index <= index <= self.last_index():
            return False
        return self.term(index) == term


class LogIndexReads:
    """The read half of :class:`~nbos.raft.storage.LogStorage`, answered from ``self._log``.

    Both stores answer reads from memory, so they share this base and differ only
    in how writes become durable.
    """

    _log: LogIndex

    @property
    def hard_state(self) -> HardState:
        return self._log.hard_state

    @property
    def snapshot(self) -> SnapshotMeta | None:
        return self._log.snapshot

    def initial_state(self) -> InitialState:
        return InitialState(self._log.hard_state, self._log.snapshot, self._log.all_entries())

    def first_index(self) -> int:
        return self._log.first_index()

    def last_index(self) -> int:
        return self._log.last_index()

    def term(self, index: int) -> int:
        return self._log.term(index)

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        return self._log.entries(lo, hi, max_bytes)


def must_sync(old: HardState, new: HardState | None, entries: Sequence[Entry]) -> bool:
    """Whether a batch changes what Raft needs durable before answering: entries, term, vote."""
    if entries:
        return True
    return new is not None and (new.term != old.term or new.vote != old.vote)


def _check_hard_state(old: HardState, new: HardState) -> None:
    if new.term < old.term:
        raise _refused(f"hard state term goes back from {old.term} to {new.term}")
    if new.term == old.term and old.vote is not None and new.vote != old.vote:
        raise _refused(f"vote in term {new.term} changes from {old.vote} to {new.vote}")


def _refused(reason: str) -> InvalidLogWriteError:
    log.warning("refused log write: %s", reason)
    return InvalidLogWriteError(reason)


def _limit_size(entries: list[Entry], max_bytes: int) -> list[Entry]:
    total = 0
    for n, entry in enumerate(entries):
        total += len(entry.data) + _ENTRY_OVERHEAD
        if total > max_bytes and n > 0:
            return entries[:n]
    return entries
