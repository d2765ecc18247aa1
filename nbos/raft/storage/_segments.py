"""WAL segment files: naming, reading back (cutting a torn tail), appending.

A segment is named ``wal-<seq>-<firstindex>.log`` (both zero-padded decimal):
``seq`` orders the segments, since after a log truncation a newer segment can
start at a lower index than an older one; ``firstindex`` is the index the next
entry had when the segment was created, for humans and tools.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from nbos.core.errors import StorageCorruptError
from nbos.core.wire.raft import Entry
from nbos.raft.storage._framing import WalRecord, scan
from nbos.raft.storage._fsutil import fsync_dir, write_all

log = logging.getLogger(__name__)

_NAME = re.compile(r"^wal-(\d{20})-(\d{20})\.log$")


@dataclass(slots=True)
class Segment:
    """One segment file and the highest entry index written into it (``0``: none)."""

    path: Path
    seq: int
    max_index: int = 0

    def note(self, records: list[WalRecord]) -> None:
        for record in records:
            if isinstance(record, Entry):
                self.max_index = max(self.max_index, record.index)


def segment_path(directory: Path, seq: int, first_index: int) -> Path:
    return directory / f"wal-{seq:020d}-{first_index:020d}.log"


def list_segments(directory: Path) -> list[Segment]:
    """The segments of ``directory``, oldest first."""
    found = []
    for path in directory.iterdir():
        m = _NAME.match(path.name)
        if m:
            found.append(Segment(path, int(m.group(1))))
    return sorted(found, key=lambda s: s.seq)


def read_segment(segment: Segment, *, last: bool) -> list[WalRecord]:
    """Records of a segment. In the last segment a torn tail is cut off the file.

    Raises ``StorageCorruptError`` naming the file and offset for a bad frame that
    cannot be a torn write: one followed by a valid frame, or any in an older segment.
    """
    buf = segment.path.read_bytes()
    result = scan(buf)
    if result.bad_offset is not None:
        if not (last and result.torn):
            raise StorageCorruptError(
                f"WAL segment {segment.path} is corrupt at offset {result.bad_offset}: "
                f"{result.bad_reason}"
            )
        log.warning(
            "cutting torn tail of %s at offset %d (%d bytes: %s)",
            segment.path,
            result.bad_offset,
            len(buf) - result.bad_offset,
            result.bad_reason,
        )
        _truncate(segment.path, result.valid_end)
    segment.note(result.records)
    return result.records


def _truncate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentFile:
    """The open segment that batches are appended to."""

    def __init__(self, segment: Segment, *, create: bool, sync: bool) -> None:
        self.segment = segment
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(segment.path, flags, 0o644)
        self.size = os.fstat(self._fd).st_size
        if create and sync:
            fsync_dir(segment.path.parent)

    def append(self, data: bytes) -> None:
        """Append ``data``; on failure cut the file back so no partial frame stays."""
        try:
            write_all(self._fd, data)
        except OSError:
            os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
