"""``DiskStorage``: the WAL, snapshot files and the in-memory log, in one data directory.

Files in the directory:

* ``wal-<seq>-<firstindex>.log``: WAL segments (see ``_segments``, ``_framing``);
* ``snap-<term>-<index>.snap``: snapshot files (see ``_snapfile``);
* ``LOCK``: held with ``flock`` while open, so two processes never share a log.

Fsync policy (``nbos.core.config.RaftSettings.fsync``):

``always``
    Every ``save`` that writes anything ends with ``fsync`` of the segment, even
    one that only moves the commit index. Everything ``save`` wrote survives a
    crash of the process, the OS or the machine once it returns.
``batch`` (the default)
    ``save`` ends with ``fsync`` when the batch holds entries or changes the term
    or the vote: what Raft must not forget before answering. A batch that only
    moves the commit index is written but synced with the next batch that needs
    it. Same safety as ``always``. Risk: after a power loss the commit index may
    go back; the node re-learns it from the leader (it applies nothing wrongly,
    it only applies later).
``never``
    No ``fsync`` at all (not of segments, snapshots or directories): data sits in
    the OS page cache. Survives a crash of the process (``kill -9``), not of the
    OS or the machine. Risk: after a power loss a node may forget a vote it cast
    or entries it acknowledged, which can elect two leaders in one term or lose
    committed entries, and an older segment may come back torn (reported as
    corruption). For tests and throw-away clusters only.

New segment files and snapshot renames and deletions are followed by an
``fsync`` of the directory under ``always`` and ``batch``.

A failed write is cut back out of the segment; a failed write or ``fsync``
makes the store refuse further writes (``StorageIOError``): after a failed
``fsync`` the kernel may have dropped the dirty pages, so retrying is unsafe.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar, get_args

from nbos.core.config import FsyncPolicy
from nbos.core.errors import ConfigError, StorageCorruptError
from nbos.core.log_storage import DEFAULT_CHUNK_BYTES, SnapshotSink
from nbos.core.wire.raft import Entry, HardState, SnapshotMeta
from nbos.raft.storage import _snapfile
from nbos.raft.storage._errors import (
    InvalidLogWriteError,
    NoSnapshotError,
    StorageIOError,
)
from nbos.raft.storage._framing import WalRecord, encode_frame
from nbos.raft.storage._fsutil import fsync_dir, fsync_file
from nbos.raft.storage._log_index import LogIndex, LogIndexReads, must_sync
from nbos.raft.storage._recovery import Replay
from nbos.raft.storage._segments import (
    Segment,
    SegmentFile,
    list_segments,
    read_segment,
    segment_path,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_SEGMENT_BYTES = 64 << 20
_CORRUPT_SUFFIX = ".corrupt"


class DiskStorage(LogIndexReads):
    """A durable :class:`~nbos.raft.storage.LogStorage` in one directory.

    Open it with :meth:`open`. Synchronous and not thread-safe: one caller at a
    time (the Raft driver calls it from one worker thread). Reads are answered
    from memory; the whole log after the snapshot is kept there.
    """

    def __init__(
        self,
        directory: Path,
        lock_fd: int,
        log_index: LogIndex,
        segments: list[Segment],
        snapshot_path: Path | None,
        *,
        fsync: FsyncPolicy,
        segment_bytes: int,
    ) -> None:
        # Use DiskStorage.open(); this only wires up what recovery found.
        self.directory = directory
        self.fsync_policy: FsyncPolicy = fsync
        self._lock_fd: int | None = lock_fd
        self._log = log_index
        self._segments = segments
        self._snapshot_path = snapshot_path
        self._segment_bytes = segment_bytes
        self._failure: str | None = None
        self._current: SegmentFile | None = None
        if segments and self._durable:
            # A previous life may have left unsynced records (commit-only ones under
            # "batch") at its tail; once a newer segment exists a torn tail there
            # would read as corruption.
            self._guard(lambda: fsync_file(segments[-1].path))
        self._guard(self._start_segment)

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "batch",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> DiskStorage:
        """Open (creating if needed) the store in ``directory`` and recover its state.

        A torn tail of the last segment is cut off the file. Raises
        ``StorageCorruptError`` (naming the file and offset) for damage that cannot
        be a torn write, and ``StorageIOError`` when the directory is in use by
        another process or cannot be read.
        """
        if segment_bytes <= 0:
            raise ConfigError("segment_bytes", segment_bytes, "a positive number of bytes")
        if fsync not in get_args(FsyncPolicy):
            raise ConfigError("fsync", fsync, " | ".join(get_args(FsyncPolicy)))
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock(path)
        except OSError as exc:
            raise StorageIOError(f"cannot open data directory {path}: {exc}") from exc
        try:
            log_index, segments, snap_path = _recover(path)
            return cls(
                path,
                lock_fd,
                log_index,
                segments,
                snap_path,
                fsync=fsync,
                segment_bytes=segment_bytes,
            )
        except OSError as exc:
            os.close(lock_fd)
            raise StorageIOError(f"cannot recover data directory {path}: {exc}") from exc
        except BaseException:
            os.close(lock_fd)
            raise

    # --- queries -------------------------------------------------------------------

    def read_snapshot(self) -> bytes:
        return b"".join(self.snapshot_chunks())

    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        if self._snapshot_path is None:
            raise NoSnapshotError()
        return _snapfile.iter_image(self._snapshot_path, chunk_bytes)

    # --- writes ----------------------------------------------------------------------

    def save(self, hard_state: HardState | None, entries: Sequence[Entry]) -> None:
        self._check_writable()
        fresh = self._log.check_save(hard_state, entries)
        if hard_state == self._log.hard_state:
            hard_state = None
        records: list[WalRecord] = list(fresh)
        if hard_state is not None:
            records.append(hard_state)
        if not records:
            return
        sync = self.fsync_policy == "always" or (
            self.fsync_policy == "batch" and must_sync(self._log.hard_state, hard_state, fresh)
        )
        self._guard(lambda: self._append(records, sync=sync))
        self._log.apply_save(hard_state, fresh)
        if self._writer().size >= self._segment_bytes:
            self._guard(self._rotate)

    def save_snapshot(self, meta: SnapshotMeta, image: bytes | Iterable[bytes]) -> None:
        sink = self.begin_snapshot(meta)
        try:
            for chunk in [image] if isinstance(image, bytes) else image:
                sink.write(chunk)
            sink.commit()
        finally:
            sink.abort()

    def begin_snapshot(self, meta: SnapshotMeta) -> SnapshotSink:
        self._check_writable()
        self._log.check_snapshot(meta)
        writer = self._guard(
            lambda: _snapfile.SnapshotFileWriter(self.directory, meta, sync=self._durable)
        )
        return _DiskSnapshotSink(self, writer)

    def _install_snapshot(self, writer: _snapfile.SnapshotFileWriter) -> None:
        # The file is durable before the marker, so a crash between the two is
        # recovered from the file alone (see Replay.entries_after).
        self._check_writable()
        self._log.check_snapshot(writer.meta)
        path = self._guard(writer.finish)
        self._guard(lambda: self._append([writer.meta], sync=self._durable))
        self._log.apply_snapshot(writer.meta)
        self._snapshot_path = path

    def compact(self, upto_index: int) -> None:
        self._check_writable()
        self._log.check_compact(upto_index)
        self._guard(lambda: self._drop_files(upto_index))

    def close(self) -> None:
        if self._current is not None:
            sync = self._durable and self._failure is None
            try:
                if sync:
                    self._current.sync()
            finally:
                self._current.close(sync=sync)
                self._current = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- internals ---------------------------------------------------------------------

    @property
    def _durable(self) -> bool:
        return self.fsync_policy != "never"

    def _writer(self) -> SegmentFile:
        if self._current is None:
            raise StorageIOError(f"storage in {self.directory} is closed")
        return self._current

    def _check_writable(self) -> None:
        self._writer()
        if self._failure is not None:
            raise StorageIOError(
                f"storage in {self.directory} failed earlier and refuses writes: {self._failure}"
            )

    def _guard(self, action: Callable[[], _T]) -> _T:
        try:
            return action()
        except OSError as exc:
            self._failure = str(exc)
            log.exception("storage in %s failed", self.directory)
            raise StorageIOError(f"storage in {self.directory} failed: {exc}") from exc

    def _append(self, records: list[WalRecord], *, sync: bool) -> None:
        try:
            data = b"".join(encode_frame(r) for r in records)
        except ValueError as exc:
            raise InvalidLogWriteError(str(exc)) from exc
        writer = self._writer()
        writer.append(data)
        writer.segment.note(records)
        if sync:
            writer.sync()

    def _rotate(self) -> None:
        writer = self._writer()
        if self._durable:
            writer.sync()
        # Cut back before a newer segment exists: in an older one, zeros are corruption.
        writer.close(sync=self._durable)
        self._current = None
        self._start_segment()

    def _start_segment(self) -> None:
        """Open a fresh segment that starts with the hard state and snapshot marker.

        Every segment carries them, so older segments can be deleted freely; a
        fresh one is also started on open, so a recovered segment is never
        appended to.
        """
        seq = self._segments[-1].seq + 1 if self._segments else 1
        segment = Segment(segment_path(self.directory, seq, self._log.last_index() + 1), seq)
        self._current = SegmentFile(segment, sync=self._durable)
        self._segments.append(segment)
        header: list[WalRecord] = [self._log.hard_state]
        if self._log.snapshot is not None:
            header.append(self._log.snapshot)
        self._append(header, sync=self._durable)

    def _drop_files(self, upto_index: int) -> None:
        # The segment holding entry ``upto_index`` itself stays: replaying a snapshot
        # marker checks the log's term at the snapshot's index, and without that entry
        # it could not tell a log the snapshot kept from one it replaced.
        while len(self._segments) > 1 and self._segments[0].max_index < upto_index:
            self._segments.pop(0).path.unlink()
            if self._durable:
                # One at a time: recovery needs the survivors to stay a run of
                # consecutive segments even if the OS reorders the deletions.
                fsync_dir(self.directory)
        for path in _snapfile.list_snapshots(self.directory):
            if path != self._snapshot_path and _snapfile.index_of(path) < upto_index:
                path.unlink()
        if self._durable:
            fsync_dir(self.directory)


class _DiskSnapshotSink:
    def __init__(self, storage: DiskStorage, writer: _snapfile.SnapshotFileWriter) -> None:
        self._storage = storage
        self._writer = writer
        self._done = False

    @property
    def meta(self) -> SnapshotMeta:
        return self._writer.meta

    def write(self, chunk: bytes) -> None:
        if self._done:
            raise InvalidLogWriteError("snapshot sink is already committed or aborted")
        self._storage._guard(lambda: self._writer.write(chunk))

    def commit(self) -> None:
        if self._done:
            raise InvalidLogWriteError("snapshot sink is already committed or aborted")
        self._done = True
        try:
            self._storage._install_snapshot(self._writer)
        finally:
            self._writer.abort()

    def abort(self) -> None:
        self._done = True
        self._writer.abort()


def _lock(directory: Path) -> int:
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _recover(directory: Path) -> tuple[LogIndex, list[Segment], Path | None]:
    for stale in directory.glob("*" + _snapfile.TMP_SUFFIX):
        stale.unlink()
    segments = list_segments(directory)
    replay = Replay()
    for n, segment in enumerate(segments):
        if n and segment.seq != segments[n - 1].seq + 1:
            raise StorageCorruptError(
                f"WAL segment before {segment.path} is missing (seq {segments[n - 1].seq + 1})"
            )
        replay.feed(read_segment(segment, last=n == len(segments) - 1))
    snapshot, snap_path, entries = _choose_snapshot(directory, replay)
    return LogIndex(replay.hard_state, snapshot, entries), segments, snap_path


def _choose_snapshot(
    directory: Path, replay: Replay
) -> tuple[SnapshotMeta | None, Path | None, list[Entry]]:
    """The newest sound snapshot, or none; the WAL must continue from it."""
    corrupt: list[Path] = []
    for path in _snapfile.list_snapshots(directory):
        try:
            meta = _snapfile.verify(path)
        except StorageCorruptError as exc:
            log.warning("skipping corrupt snapshot: %s", exc)
            corrupt.append(path)
            continue
        return _continue_from(meta, path, replay, corrupt)
    return _continue_from(None, None, replay, corrupt)


def _continue_from(
    meta: SnapshotMeta | None, path: Path | None, replay: Replay, corrupt: list[Path]
) -> tuple[SnapshotMeta | None, Path | None, list[Entry]]:
    entries = replay.entries_after(meta)
    if entries is None:
        base = f"snapshot {path}" if path else "the start of the log"
        raise StorageCorruptError(
            f"the WAL does not continue from {base}"
            + (f"; corrupt snapshots: {', '.join(map(str, corrupt))}" if corrupt else "")
        )
    for bad in corrupt:
        # Fallen back past it: keep it for inspection, out of the way of later opens.
        log.warning("falling back past corrupt snapshot %s", bad)
        bad.rename(bad.with_name(bad.name + _CORRUPT_SUFFIX))
    return meta, path, entries
