"""The in-memory view of one node's Raft log.

Entries ``first_index() .. last_index()`` are held in memory; everything at or
below ``offset`` was compacted into a snapshot whose ``(offset, offset_term)``
is still known, so ``term(offset)`` answers. ``stable`` is the last index
storage has acknowledged durable; entries above it are *unstable* and go out in
the next ``Ready``. The log never holds a committed index it cannot prove:
a truncation at or below ``committed`` is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from nbos.core.errors import ReplicationError
from nbos.core.wire.raft import Entry

log = logging.getLogger(__name__)

#: Per-entry bytes counted on top of the payload when batching appends.
ENTRY_OVERHEAD = 16


def entry_size(entry: Entry) -> int:
    """Approximate encoded size of ``entry``, for batching."""
    return len(entry.data) + ENTRY_OVERHEAD


class RaftLog:
    """Entries after a compaction offset, with commit, apply and durability marks."""

    def __init__(self, offset: int, offset_term: int, entries: Sequence[Entry] = ()) -> None:
        self.offset = offset
        self.offset_term = offset_term
        self.entries: list[Entry] = []
        # storage may still hold entries the snapshot covers: they are not needed
        kept = [e for e in entries if e.index > offset]
        for expected, entry in enumerate(kept, start=offset + 1):
            if entry.index != expected:
                raise ReplicationError(f"log gap: entry {entry.index} where {expected} was due")
            self.entries.append(entry)
        self.stable = self.last_index()
        self.committed = offset
        self.applied = offset

    # --- positions --------------------------------------------------------------

    def first_index(self) -> int:
        return self.offset + 1

    def last_index(self) -> int:
        return self.offset + len(self.entries)

    def last_term(self) -> int:
        term = self.term(self.last_index())
        assert term is not None  # the last index is always known
        return term

    def term(self, index: int) -> int | None:
        """Term of ``index``; ``None`` when compacted away or not yet in the log."""
        if index == self.offset:
            return self.offset_term
        if index < self.offset or index > self.last_index():
            return None
        return self.entries[index - self.offset - 1].term

    def match_term(self, index: int, term: int) -> bool:
        return self.term(index) == term

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Whether a log ending at ``(last_index, last_term)`` is at least as up to date."""
        mine = self.last_term()
        return last_term > mine or (last_term == mine and last_index >= self.last_index())

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """Largest index ``<= index`` whose term is ``<= term`` (or the offset)."""
        index = min(index, self.last_index())
        while index > self.offset:
            found = self.term(index)
            if found is not None and found <= term:
                break
            index -= 1
        return index

    # --- reading ----------------------------------------------------------------

    def slice(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries ``[lo, hi)``, cut after ``max_bytes`` (at least one entry)."""
        if lo <= self.offset:
            raise ReplicationError(f"entries from {lo} were compacted (offset {self.offset})")
        out = self.entries[lo - self.offset - 1 : hi - self.offset - 1]
        if max_bytes is None:
            return out
        size = 0
        for n, entry in enumerate(out):
            size += entry_size(entry)
            if size > max_bytes and n > 0:
                return out[:n]
        return out

    def unstable_entries(self) -> list[Entry]:
        return self.entries[self.stable - self.offset :]

    def next_committed(self) -> list[Entry]:
        """Committed entries not yet handed out for apply."""
        if self.committed <= self.applied:
            return []
        return self.slice(self.applied + 1, self.committed + 1)

    # --- writing ----------------------------------------------------------------

    def append(self, entries: Sequence[Entry]) -> None:
        """Append contiguous ``entries``, truncating any conflicting suffix first."""
        if not entries:
            return
        start = entries[0].index
        if start <= self.committed:
            raise ReplicationError(f"refusing to truncate committed index {self.committed}")
        if start > self.last_index() + 1:
            raise ReplicationError(f"append at {start} leaves a gap after {self.last_index()}")
        del self.entries[start - self.offset - 1 :]
        self.stable = min(self.stable, start - 1)
        self.entries.extend(entries)

    def maybe_append(
        self, prev_index: int, prev_term: int, commit: int, entries: Sequence[Entry]
    ) -> int | None:
        """AppendEntries on a follower; returns the last new matching index or ``None``."""
        if not self.match_term(prev_index, prev_term):
            return None
        last_new = prev_index + len(entries)
        fresh = [e for e in entries if not self.match_term(e.index, e.term)]
        # entries at or below the offset are committed and already compacted: skip them
        fresh = [e for e in fresh if e.index > self.offset]
        if fresh:
            self.append(self._contiguous_tail(fresh, entries))
        self.commit_to(min(commit, last_new))
        return last_new

    @staticmethod
    def _contiguous_tail(fresh: list[Entry], entries: Sequence[Entry]) -> list[Entry]:
        # everything from the first conflict on replaces our suffix
        first = fresh[0].index
        return [e for e in entries if e.index >= first]

    def commit_to(self, index: int) -> None:
        if index > self.committed:
            self.committed = min(index, self.last_index())

    def maybe_commit(self, index: int, term: int) -> bool:
        """Commit up to ``index`` if it is of ``term`` (Figure 8: only count the current term)."""
        if index > self.committed and self.term(index) == term:
            self.committed = index
            return True
        return False

    def stable_to(self, index: int, term: int) -> None:
        """Storage made ``index`` durable; ignored if that entry was since replaced."""
        if self.term(index) == term and index > self.stable:
            self.stable = index

    def applied_to(self, index: int) -> None:
        self.applied = max(self.applied, min(index, self.committed))

    def restore(self, index: int, term: int) -> None:
        """Reset to an installed snapshot: no entries, everything up to ``index`` committed."""
        self.offset, self.offset_term = index, term
        self.entries = []
        self.stable = index
        self.committed = index
        self.applied = index

    def compact(self, index: int) -> None:
        """Drop entries up to ``index`` (which must be applied)."""
        if index <= self.offset:
            return
        if index > self.applied:
            raise ReplicationError(f"cannot compact to {index}: only {self.applied} applied")
        term = self.term(index)
        assert term is not None
        del self.entries[: index - self.offset]
        self.offset, self.offset_term = index, term
