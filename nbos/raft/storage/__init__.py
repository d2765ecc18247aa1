"""The durable Raft log store: a WAL in segment files, snapshot files, and an in-memory twin.

* :class:`DiskStorage` keeps a node's hard state, log and snapshots in one data
  directory; see ``docs/storage.md`` for the file formats, recovery and the
  fsync policies.
* :class:`MemoryStorage` has the same interface with no disk, for the simulator
  and tests.

Both implement :class:`~nbos.core.log_storage.LogStorage`. They are synchronous and
not thread-safe.
"""

from nbos.raft.storage._disk import DEFAULT_SEGMENT_BYTES, DiskStorage
from nbos.raft.storage._errors import (
    InvalidLogWriteError,
    LogCompactedError,
    LogUnavailableError,
    NoSnapshotError,
    SnapshotOutOfDateError,
    StorageIOError,
)
from nbos.raft.storage._memory import MemoryStorage

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DiskStorage",
    "InvalidLogWriteError",
    "LogCompactedError",
    "LogUnavailableError",
    "MemoryStorage",
    "NoSnapshotError",
    "SnapshotOutOfDateError",
    "StorageIOError",
]
