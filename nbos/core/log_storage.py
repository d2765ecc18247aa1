"""The ``LogStorage`` interface: a Raft node's durable state, which the Raft driver plugs in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from nbos.core.wire.raft import Entry, HardState, SnapshotMeta

#: Default size of one streamed snapshot chunk.
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class InitialState:
    """What a node starts from: its hard state, its snapshot (if any), the entries after it."""

    hard_state: HardState
    snapshot: SnapshotMeta | None
    entries: list[Entry] = field(default_factory=list)


@runtime_checkable
class SnapshotSink(Protocol):
    """An incoming snapshot, written chunk by chunk (the chunked InstallSnapshot).

    Nothing is visible until :meth:`commit`; :meth:`abort` (or an error) leaves the
    store as it was. A sink is used once.
    """

    @property
    def meta(self) -> SnapshotMeta:
        """The position and membership the image stands for."""
        ...

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` to the image."""
        ...

    def commit(self) -> None:
        """Make the snapshot durable and current, then compact the log to it."""
        ...

    def abort(self) -> None:
        """Drop what was written; idempotent, and a no-op after :meth:`commit`."""
        ...


@runtime_checkable
class LogStorage(Protocol):
    """A node's durable Raft state: hard state, log entries, the latest snapshot.

    Indices are 1-based. ``first_index`` is the first entry still held (one past
    the snapshot) and ``last_index`` the last one (the snapshot index when the log
    after it is empty). Implementations are synchronous and **not thread-safe**:
    one caller at a time (the driver runs them in one worker thread).

    * ``save(hard_state, entries)`` persists a batch: entries first (an entry at an
      index that already exists replaces it and every entry after it, as Raft's
      conflict rule wants), then the hard state. Entries at or before the snapshot
      are committed and are skipped. When it returns, what it wrote is as durable
      as the store's fsync policy promises.
    * ``save_snapshot``/``begin_snapshot`` store an image and compact the log to it:
      entries after the snapshot survive only if the log holds the snapshot's own
      index with the same term (Raft's InstallSnapshot rule); otherwise the log
      becomes empty after the snapshot.
    * ``compact(upto_index)`` frees what is needed only to recover to a point
      before ``upto_index`` (which must not exceed the snapshot's index).
    """

    @property
    def hard_state(self) -> HardState:
        """The last saved hard state."""
        ...

    @property
    def snapshot(self) -> SnapshotMeta | None:
        """The current snapshot's metadata, if there is a snapshot."""
        ...

    def initial_state(self) -> InitialState:
        """The state a node (re)starts from."""
        ...

    def first_index(self) -> int:
        """Index of the first entry held: the snapshot index + 1, or 1."""
        ...

    def last_index(self) -> int:
        """Index of the last entry, or the snapshot index when there is none after it."""
        ...

    def term(self, index: int) -> int:
        """Term of the entry at ``index``; the snapshot's index answers the snapshot's term.

        ``index == 0`` answers 0 when there is no snapshot. Raises
        ``LogCompactedError`` before the snapshot, ``LogUnavailableError`` after the end.
        """
        ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries ``lo <= index < hi``; with ``max_bytes``, a prefix of about that size.

        At least one entry is returned when the range is not empty, however large.
        """
        ...

    def save(self, hard_state: HardState | None, entries: Sequence[Entry]) -> None:
        """Persist a batch (see the class docstring)."""
        ...

    def save_snapshot(self, meta: SnapshotMeta, image: bytes | Iterable[bytes]) -> None:
        """Store a whole image (bytes or an iterable of chunks) and compact to it."""
        ...

    def begin_snapshot(self, meta: SnapshotMeta) -> SnapshotSink:
        """Start receiving an image chunk by chunk."""
        ...

    def read_snapshot(self) -> bytes:
        """The current snapshot image; raises ``LogUnavailableError`` if there is none."""
        ...

    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """The current image in chunks of at most ``chunk_bytes`` (empty image: no chunk)."""
        ...

    def compact(self, upto_index: int) -> None:
        """Free storage needed only to recover to a point before ``upto_index``."""
        ...

    def close(self) -> None:
        """Release files; the store cannot be used afterwards."""
        ...
