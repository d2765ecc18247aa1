"""Snapshot files: ``snap-<term>-<index>.snap``, written atomically, checked on read.

Layout: ``MAGIC (8) | meta length (u32) | meta (msgpack SnapshotMeta) | image |
image length (u64) | crc (u32)``, all little-endian, where ``crc`` is zlib's
CRC-32 of everything before the trailer. A file is written under a ``.tmp``
name, synced, renamed into place, and its directory synced, so a crash leaves
either the whole old set of files or the whole new one.

Images stream in and out in chunks, so a snapshot is never held in memory
whole (let alone twice). Reading checks the checksum before handing out the
last chunk: a consumer that has seen the final chunk has seen a sound image.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from nbos.core.errors import ConfigError, StorageCorruptError
from nbos.core.wire.raft import SnapshotMeta
from nbos.raft.storage._fsutil import fsync_dir, write_all

MAGIC = b"NBSNAP01"
_META_LEN = struct.Struct("<I")
_TRAILER = struct.Struct("<QI")
_NAME = re.compile(r"^snap-(\d{20})-(\d{20})\.snap$")
TMP_SUFFIX = ".tmp"

_meta_decoder = msgspec.msgpack.Decoder(SnapshotMeta)
_encoder = msgspec.msgpack.Encoder()


def snapshot_name(meta: SnapshotMeta) -> str:
    return f"snap-{meta.term:020d}-{meta.index:020d}.snap"


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshot files of ``directory``, newest (highest index, then term) first."""
    found: list[tuple[int, int, Path]] = []
    for path in directory.iterdir():
        m = _NAME.match(path.name)
        if m:
            found.append((int(m.group(2)), int(m.group(1)), path))
    return [p for _, _, p in sorted(found, reverse=True)]


def index_of(path: Path) -> int:
    """The log index in a snapshot file's name."""
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"not a snapshot file name: {path.name}")
    return int(m.group(2))


class SnapshotFileWriter:
    """Writes one snapshot file; :meth:`finish` publishes it, :meth:`abort` drops it."""

    def __init__(self, directory: Path, meta: SnapshotMeta, *, sync: bool) -> None:
        self.meta = meta
        self._dir = directory
        self._sync = sync
        self._final = directory / snapshot_name(meta)
        self._tmp = directory / (self._final.name + TMP_SUFFIX)
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        meta_bytes = _encoder.encode(meta)
        header = MAGIC + _META_LEN.pack(len(meta_bytes)) + meta_bytes
        self._crc = 0
        self._image_len = 0
        self._write(header)

    def write(self, chunk: bytes) -> None:
        self._write(chunk)
        self._image_len += len(chunk)

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError("snapshot writer is closed")
        write_all(self._fd, data)
        self._crc = zlib.crc32(data, self._crc)

    def finish(self) -> Path:
        """Write the trailer, sync, rename into place; returns the final path."""
        fd = self._fd
        if fd is None:
            raise ValueError("snapshot writer is closed")
        write_all(fd, _TRAILER.pack(self._image_len, self._crc))
        if self._sync:
            os.fsync(fd)
        os.close(fd)
        self._fd = None
        os.replace(self._tmp, self._final)
        if self._sync:
            fsync_dir(self._dir)
        return self._final

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._tmp.unlink(missing_ok=True)


def read_meta(path: Path) -> SnapshotMeta:
    """The metadata in a snapshot file's header (the image is not checked)."""
    with path.open("rb") as f:
        return _read_header(f, path)[1]


def verify(path: Path) -> SnapshotMeta:
    """Check the whole file; returns its metadata or raises ``StorageCorruptError``."""
    for _ in iter_image(path, 1 << 22):
        pass
    return read_meta(path)


def iter_image(path: Path, chunk_bytes: int) -> Iterator[bytes]:
    """The image in chunks; the checksum is checked before the last chunk is yielded."""
    if chunk_bytes <= 0:
        raise ConfigError("chunk_bytes", chunk_bytes, "a positive number of bytes")
    with path.open("rb") as f:
        header, _ = _read_header(f, path)
        image_len = os.fstat(f.fileno()).st_size - len(header) - _TRAILER.size
        if image_len < 0:
            raise _corrupt(path, len(header), "file ends inside the trailer")
        crc = zlib.crc32(header)
        pending: bytes | None = None
        remaining = image_len
        while remaining:
            chunk = f.read(min(chunk_bytes, remaining))
            if not chunk:
                raise _corrupt(path, f.tell(), "file shrank while being read")
            remaining -= len(chunk)
            crc = zlib.crc32(chunk, crc)
            if pending is not None:
                yield pending
            pending = chunk
        stored_len, stored_crc = _TRAILER.unpack(f.read(_TRAILER.size))
        if stored_len != image_len or stored_crc != crc:
            raise _corrupt(path, len(header) + image_len, "checksum or length mismatch")
        if pending is not None:
            yield pending


def _read_header(f: BinaryIO, path: Path) -> tuple[bytes, SnapshotMeta]:
    head = f.read(len(MAGIC) + _META_LEN.size)
    if len(head) < len(MAGIC) + _META_LEN.size or not head.startswith(MAGIC):
        raise _corrupt(path, 0, "bad or short header")
    (meta_len,) = _META_LEN.unpack_from(head, len(MAGIC))
    meta_bytes = f.read(meta_len)
    try:
        meta = _meta_decoder.decode(meta_bytes)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise _corrupt(path, len(head), f"undecodable metadata: {exc}") from exc
    return head + meta_bytes, meta


def _corrupt(path: Path, offset: int, reason: str) -> StorageCorruptError:
    return StorageCorruptError(f"snapshot {path} is corrupt at offset {offset}: {reason}")
