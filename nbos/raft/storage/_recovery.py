"""Replaying WAL records into the log a node restarts with.

Replay follows the write rules: an entry at an index the log already holds
replaces it and drops everything after it; a snapshot marker (written when a
snapshot was stored) drops the whole log when the log disagrees with the
snapshot at its index, as the InstallSnapshot rule did at run time. Entries
the snapshot covers are kept until the end, so that an older snapshot can be
used when the newest snapshot file is corrupt.
"""

from __future__ import annotations

from nbos.core.wire.raft import Entry, HardState, SnapshotMeta
from nbos.raft.storage._framing import WalRecord


class Replay:
    """The log rebuilt from WAL records, before a snapshot is chosen."""

    def __init__(self) -> None:
        self.hard_state = HardState()
        self._entries: list[Entry] = []
        # The last snapshot marker that dropped the log: no entry at or before it
        # can come from the WAL, so only a snapshot at least as new can stand for them.
        self._reset: SnapshotMeta | None = None
        # The last marker seen: every new segment repeats it, and a repeat agrees with
        # the log even when the segments holding the entries before it are gone.
        self._marker_seen: SnapshotMeta | None = None

    def feed(self, records: list[WalRecord]) -> None:
        for record in records:
            if isinstance(record, Entry):
                self._entry(record)
            elif isinstance(record, HardState):
                self.hard_state = record
            else:
                self._marker(record)

    def _entry(self, entry: Entry) -> None:
        first = self._entries[0].index if self._entries else 0
        if self._entries and first <= entry.index <= self._entries[-1].index + 1:
            del self._entries[entry.index - first :]
            self._entries.append(entry)
        else:
            # The first entry seen, or one after a marker dropped the log (or after
            # lost files): where the log starts is judged against the snapshot.
            self._entries = [entry]

    def _marker(self, meta: SnapshotMeta) -> None:
        if not _same_position(meta, self._marker_seen) and not self._term_matches(
            meta.index, meta.term
        ):
            self._entries = []
            self._reset = meta
        self._marker_seen = meta

    def _term_matches(self, index: int, term: int) -> bool:
        if index == 0:  # the start of every log
            return term == 0
        if not self._entries or not self._entries[0].index <= index <= self._entries[-1].index:
            return False
        return self._entries[index - self._entries[0].index].term == term

    def entries_after(self, snapshot: SnapshotMeta | None) -> list[Entry] | None:
        """The entries after ``snapshot``, or ``None`` if the WAL cannot continue from it."""
        snap_index = snapshot.index if snapshot else 0
        if self._reset is not None and not _same_or_newer(snapshot, self._reset):
            return None
        if not self._entries:
            return []
        first = self._entries[0].index
        if first > snap_index + 1:
            return None
        if first == snap_index + 1:
            return list(self._entries)
        assert snapshot is not None  # first <= snap_index, and first >= 1
        if self._entries[-1].index <= snap_index:
            return []
        if not self._term_matches(snap_index, snapshot.term):
            # The snapshot replaced a disagreeing log and the crash came before its marker.
            return []
        return self._entries[snap_index + 1 - first :]


def _same_position(a: SnapshotMeta, b: SnapshotMeta | None) -> bool:
    return b is not None and (a.index, a.term) == (b.index, b.term)


def _same_or_newer(snapshot: SnapshotMeta | None, reset: SnapshotMeta) -> bool:
    if snapshot is None:
        return False
    return _same_position(reset, snapshot) or snapshot.index > reset.index
