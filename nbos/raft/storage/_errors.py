"""Typed errors of the log store.

They live here rather than in :mod:`nbos.core.errors` because only the Raft
layer raises or catches them; each derives from
:class:`~nbos.core.errors.ReplicationError`, so callers that catch the nbos
hierarchy catch these too.
"""

from __future__ import annotations

from nbos.core.errors import ReplicationError


class LogCompactedError(ReplicationError):
    """The asked-for index lies at or before the snapshot: its entry is gone."""

    def __init__(self, index: int, first_index: int) -> None:
        self.index = index
        self.first_index = first_index
        super().__init__(f"log index {index} is compacted (first index is {first_index})")


class LogUnavailableError(ReplicationError):
    """The asked-for index lies after the last entry of the log."""

    def __init__(self, index: int, last_index: int) -> None:
        self.index = index
        self.last_index = last_index
        super().__init__(f"log index {index} is beyond the last index {last_index}")


class NoSnapshotError(ReplicationError):
    """A snapshot image was asked for, but none is stored."""

    def __init__(self) -> None:
        super().__init__("no snapshot is stored")


class InvalidLogWriteError(ReplicationError):
    """A write would break a log invariant (gap, non-consecutive indices, term going back)."""


class SnapshotOutOfDateError(InvalidLogWriteError):
    """A snapshot older than the one already stored was offered."""

    def __init__(self, index: int, current: int) -> None:
        self.index = index
        self.current = current
        super().__init__(f"snapshot at index {index} is older than the stored one at {current}")


class StorageIOError(ReplicationError):
    """The disk failed a write or sync; the store refuses further writes.

    After a failed ``fsync`` the kernel may have dropped the dirty pages, so a
    retry could report success for data that is not on disk: the only safe
    course is to stop this node and recover it from its data directory.
    """
