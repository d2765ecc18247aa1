"""``MemoryStorage``: the log store without a disk, for the simulator and tests.

Everything saved counts as durable: a simulated crash keeps the object (or a
:meth:`MemoryStorage.restarted` copy) and a node restarts from
:meth:`initial_state`. It enforces the same write rules as ``DiskStorage``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from nbos.core.errors import ConfigError
from nbos.core.log_storage import DEFAULT_CHUNK_BYTES, SnapshotSink
from nbos.core.wire.raft import Entry, HardState, SnapshotMeta
from nbos.raft.storage._errors import InvalidLogWriteError, NoSnapshotError
from nbos.raft.storage._log_index import LogIndex, LogIndexReads


class MemoryStorage(LogIndexReads):
    """An in-memory :class:`~nbos.raft.storage.LogStorage`; not thread-safe."""

    def __init__(self) -> None:
        self._log = LogIndex()
        # The image is kept as the chunks it came in, so it is never copied whole.
        self._image: list[bytes] | None = None
        self._closed = False

    def restarted(self) -> MemoryStorage:
        """A new store holding exactly this one's durable state, as after a restart."""
        fresh = MemoryStorage()
        fresh._log = LogIndex(self._log.hard_state, self._log.snapshot, self._log.all_entries())
        fresh._image = None if self._image is None else list(self._image)
        return fresh

    def save(self, hard_state: HardState | None, entries: Sequence[Entry]) -> None:
        self._check_open()
        fresh = self._log.check_save(hard_state, entries)
        self._log.apply_save(hard_state, fresh)

    def save_snapshot(self, meta: SnapshotMeta, image: bytes | Iterable[bytes]) -> None:
        sink = self.begin_snapshot(meta)
        for chunk in [image] if isinstance(image, bytes) else image:
            sink.write(chunk)
        sink.commit()

    def begin_snapshot(self, meta: SnapshotMeta) -> SnapshotSink:
        self._check_open()
        self._log.check_snapshot(meta)
        return _MemorySnapshotSink(self, meta)

    def _install_snapshot(self, meta: SnapshotMeta, image: list[bytes]) -> None:
        self._check_open()
        self._log.check_snapshot(meta)
        self._log.apply_snapshot(meta)
        self._image = image

    def read_snapshot(self) -> bytes:
        return b"".join(self._chunks())

    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        if chunk_bytes <= 0:
            raise ConfigError("chunk_bytes", chunk_bytes, "a positive number of bytes")
        for chunk in self._chunks():
            view = memoryview(chunk)
            for start in range(0, len(view), chunk_bytes):
                yield bytes(view[start : start + chunk_bytes])

    def _chunks(self) -> list[bytes]:
        if self._image is None:
            raise NoSnapshotError()
        return [c for c in self._image if c]

    def compact(self, upto_index: int) -> None:
        self._check_open()
        self._log.check_compact(upto_index)

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidLogWriteError("storage is closed")


class _MemorySnapshotSink:
    def __init__(self, storage: MemoryStorage, meta: SnapshotMeta) -> None:
        self._storage = storage
        self._meta = meta
        self._chunks: list[bytes] = []
        self._done = False

    @property
    def meta(self) -> SnapshotMeta:
        return self._meta

    def write(self, chunk: bytes) -> None:
        self._check_live()
        self._chunks.append(bytes(chunk))

    def commit(self) -> None:
        self._check_live()
        self._done = True
        self._storage._install_snapshot(self._meta, self._chunks)

    def abort(self) -> None:
        self._done = True
        self._chunks = []

    def _check_live(self) -> None:
        if self._done:
            raise InvalidLogWriteError("snapshot sink is already committed or aborted")
