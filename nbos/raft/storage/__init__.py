"""The durable Raft log store: a WAL in segment files, snapshot files, and an in-memory twin.

* :class:`DiskStorage` keeps a node's hard state, log and snapshots in one data
  directory; see ``docs/storage.md`` for the file formats, recovery and the
  fsync policies.
* :class:`MemoryStorage` has the same interface with no disk, for the simulator
  and tests.

Both implement :class:`LogStorage`. They are synchronous and not thread-safe.
"""

from nbos.raft.storage._api import DEFAULT_CHUNK_BYTES, InitialState, LogStorage, SnapshotSink
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
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "DiskStorage",
    "InitialState",
    "InvalidLogWriteError",
    "LogCompactedError",
    "LogStorage",
    "LogUnavailableError",
    "MemoryStorage",
    "NoSnapshotError",
    "SnapshotOutOfDateError",
    "SnapshotSink",
    "StorageIOError",
]
