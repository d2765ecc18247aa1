"""The embedded object store: one file per blob in a local directory.

Layout: ``root/ab/cdef...`` holds the blob whose digest is ``abcdef...`` (the fan-out
keeps directories small); ``root/tmp/*.part`` are blobs being written. A writer holds
an exclusive ``flock`` on its part file until the file is renamed into place or
removed, so opening the store (which removes the part files that crashed writers
left behind) never removes the part file of a live writer, even in another process.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

from nbos.core.config import StoreSettings
from nbos.core.errors import BlobNotFoundError, ConfigError, StoreError
from nbos.core.ids import BlobKey
from nbos.store._chunks import check_chunk_size
from nbos.store._keys import digest_of, key_of, new_hasher, verify

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

_TMP_DIR = "tmp"
_PART_SUFFIX = ".part"
_CREATE_ATTEMPTS = 8
# Slices of a buffer written in place: large enough that the thread hop per slice is
# noise, small enough that a cancelled write stops soon.
_BUFFER_CHUNK = 16 << 20
# Chunks this large are hashed and written at once, on two threads.
_PARALLEL_HASH = 1 << 20


class LocalObjectStore:
    """An :class:`~nbos.core.object_store.ObjectStore` in a local directory.

    Writes are atomic and durable: the content is fsynced in a part file, renamed onto
    its final path, and the directory is fsynced, so after a crash a key names either
    the whole blob or nothing. Several stores (in several processes) may share ``root``.

    The constructor does blocking I/O (creates ``root``, removes stale part files):
    call it at start-up, or through ``anyio.to_thread.run_sync`` from async code.
    Raises :class:`StoreError` if ``root`` cannot be created.
    """

    def __init__(self, root: Path) -> None:
        self._root = Path(root)
        self._tmp = self._root / _TMP_DIR
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            removed = _remove_stale_parts(self._tmp)
        except OSError as exc:
            logger.warning("cannot open object store at %s: %s", self._root, exc)
            raise StoreError(f"cannot open object store at {self._root}: {exc}") from exc
        if removed:
            logger.info("removed %d unfinished blob writes under %s", removed, self._tmp)

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> LocalObjectStore:
        """The store at ``settings.path``; raises :class:`ConfigError` if it is empty."""
        if not settings.path:
            raise ConfigError("store.path", settings.path, "a directory for the local store")
        return cls(Path(settings.path))

    @property
    def root(self) -> Path:
        """The directory that holds the blobs."""
        return self._root

    def path_of(self, key: BlobKey) -> Path:
        """Where the blob ``key`` lives (whether or not it is stored)."""
        digest = digest_of(key)
        return self._root / digest[:2] / digest[2:]

    async def put(self, data: bytes) -> BlobKey:
        """Store ``data``; a blob that is already stored is not written again."""
        return await _io(f"cannot write a blob under {self._root}", self._put_bytes, data)

    async def put_stream(self, chunks: AsyncIterable[bytes]) -> BlobKey:
        """Store the concatenation of ``chunks``, one chunk in memory at a time."""
        return await self._put_chunks(chunks)

    async def put_buffer(self, parts: Sequence[bytes | memoryview]) -> BlobKey:
        """Store the concatenation of ``parts`` without copying them: each byte is read
        once, by the hash and the write of the same pass (not part of the
        ``ObjectStore`` interface; the state layer uses it when a store has it).

        Same guarantees as :meth:`put_stream`; the key is that of the bytes as read, so
        a caller that writes ``parts`` meanwhile gets a consistent blob of some of both.
        """
        return await self._put_chunks(_slices(parts, _BUFFER_CHUNK))

    async def _put_chunks(self, chunks: AsyncIterable[bytes | memoryview]) -> BlobKey:
        what = f"cannot write a blob under {self._root}"
        part = await _io(what, _PartFile, self._tmp)
        try:
            async for chunk in chunks:
                await _io(what, part.write, chunk)
            return await _io(what, part.commit, self._root)
        finally:
            # Shielded: a cancelled put must still remove its part file.
            with anyio.CancelScope(shield=True):
                await _io(what, part.close)

    async def get(self, key: BlobKey) -> bytes:
        """The whole blob, verified against ``key``."""
        path = self.path_of(key)
        return await _io(f"cannot read blob {key}", _read_verified, path, key)

    async def get_stream(self, key: BlobKey, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The blob in chunks of ``chunk_size`` bytes (the last may be shorter).

        The content is verified as it streams: :class:`BlobCorruptError` comes after the
        last chunk, so a consumer must not trust the data until the iteration ends.
        """
        check_chunk_size(chunk_size)
        path = self.path_of(key)
        what = f"cannot read blob {key}"
        file = await _io(what, _open_blob, path, key)
        hasher = new_hasher()
        try:
            while chunk := await _io(what, _read_hashed, file, chunk_size, hasher):
                yield chunk
        finally:
            file.close()
        verify(hasher, key)

    async def contains(self, key: BlobKey) -> bool:
        """Whether a blob is stored under ``key`` (without verifying its content)."""
        path = self.path_of(key)
        return await _io(f"cannot look up blob {key}", path.is_file)

    async def delete(self, key: BlobKey) -> None:
        """Remove the blob; a missing blob is not an error."""
        path = self.path_of(key)
        await _io(f"cannot delete blob {key}", functools.partial(path.unlink, missing_ok=True))

    async def aclose(self) -> None:
        """Nothing to release: every operation closes its own files."""

    def _put_bytes(self, data: bytes) -> BlobKey:
        key = key_of(new_hasher(data))
        if _has_size(self.path_of(key), len(data)):
            return key
        with _PartFile(self._tmp) as part:
            part.write(data)
            return part.commit(self._root)


class _PartFile:
    """A blob being written: a locked part file in ``tmp`` plus the running hash.

    Blocking; each method runs in a worker thread.
    """

    def __init__(self, tmp: Path) -> None:
        self._path, self._fd = _create_locked(tmp)
        self._hasher = new_hasher()
        self._size = 0
        self._committed = False

    def write(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        self._size += view.nbytes
        if view.nbytes < _PARALLEL_HASH:
            self._hasher.update(view)
            self._write_all(view)
            return
        # Both release the GIL: hash on a second core while this one writes.
        hashing = threading.Thread(target=self._hasher.update, args=(view,))
        hashing.start()
        try:
            self._write_all(view)
        finally:
            hashing.join()

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def commit(self, root: Path) -> BlobKey:
        """Make the content durable and move it onto its final path; returns its key.

        A blob of the right size already there is kept, as :meth:`LocalObjectStore.put`
        keeps it (a truncated one is replaced): then the part file is dropped unsynced.
        """
        key = key_of(self._hasher)
        digest = digest_of(key)
        directory = root / digest[:2]
        if _has_size(directory / digest[2:], self._size):
            return key
        os.fsync(self._fd)
        _ensure_dir(directory, root)
        # Replacing an existing blob is harmless (same content) and repairs a damaged one.
        os.replace(self._path, directory / digest[2:])
        _fsync_dir(directory)
        self._committed = True
        return key

    def close(self) -> None:
        """Remove the part file unless committed, and release the lock; idempotent."""
        if self._fd < 0:
            return
        try:
            if not self._committed:
                self._path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> _PartFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _slices(parts: Sequence[bytes | memoryview], size: int) -> AsyncIterator[memoryview]:
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, size):
            yield view[start : start + size]


async def _io(what: str, func: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
    """Run blocking ``func`` in a worker thread; an ``OSError`` becomes a :class:`StoreError`."""
    try:
        return await anyio.to_thread.run_sync(func, *args)
    except OSError as exc:
        logger.warning("%s: %s", what, exc)
        raise StoreError(f"{what}: {exc}") from exc


def _create_locked(tmp: Path) -> tuple[Path, int]:
    """Create and ``flock`` a fresh part file, retrying if a concurrent cleanup took it
    between creation and locking."""
    for _ in range(_CREATE_ATTEMPTS):
        path = tmp / f"{uuid.uuid4().hex}{_PART_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink > 0:
                return path, fd
        except BlockingIOError:
            pass  # a cleanup holds it and is about to remove it
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise StoreError(f"cannot create a part file in {tmp}: removed by concurrent cleanups")


def _remove_stale_parts(tmp: Path) -> int:
    """Remove the part files that no live writer holds; returns how many."""
    removed = 0
    for entry in os.scandir(tmp):
        if not entry.name.endswith(_PART_SUFFIX):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # committed or removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
        except BlockingIOError:
            continue  # a live writer holds it
        finally:
            os.close(fd)
    return removed


def _ensure_dir(directory: Path, parent: Path) -> None:
    try:
        directory.mkdir()
    except FileExistsError:
        return
    _fsync_dir(parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _open_blob(path: Path, key: BlobKey) -> BinaryIO:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise BlobNotFoundError(key) from None


def _read_hashed(file: BinaryIO, size: int, hasher: hashlib._Hash) -> bytes:
    chunk = file.read(size)
    hasher.update(chunk)
    return chunk


def _read_verified(path: Path, key: BlobKey) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BlobNotFoundError(key) from None
    verify(new_hasher(data), key)
    return data
