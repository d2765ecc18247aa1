"""DiskStorage snapshots: compaction, restart, corrupt-snapshot fallback, streaming, crashes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from nbos.core.errors import StorageCorruptError
from nbos.core.wire.raft import ConfState, Entry, HardState, SnapshotMeta
from nbos.raft.storage import DiskStorage

SEG = 300  # bytes: small segments, so compaction has files to drop


def entry(i: int, term: int = 1) -> Entry:
    return Entry(term=term, index=i, data=b"e%d" % i)


def meta(index: int, term: int = 1) -> SnapshotMeta:
    return SnapshotMeta(index=index, term=term, conf=ConfState(voters=[1, 2, 3]))


def image(index: int) -> bytes:
    return b"state-at-%d;" % index * 50


def files(d: Path, pattern: str) -> list[Path]:
    return sorted(p for p in d.iterdir() if re.match(pattern, p.name))


def wal_files(d: Path) -> list[Path]:
    return files(d, r"wal-\d+-\d+\.log$")


def snap_files(d: Path) -> list[Path]:
    return files(d, r"snap-\d+-\d+\.snap$")


def build(d: Path, n: int, snapshots: list[int], compact_to: int | None) -> None:
    """Entries 1..n saved in batches of 5, snapshots at the given indices, one compaction."""
    s = DiskStorage.open(d, segment_bytes=SEG)
    s.save(HardState(term=1, vote=1), [])
    for lo in range(1, n + 1, 5):
        s.save(HardState(term=1, vote=1, commit=lo - 1), [entry(i) for i in range(lo, lo + 5)])
        for at in snapshots:
            if lo <= at < lo + 5:
                s.save_snapshot(meta(at), image(at))
    if compact_to is not None:
        s.compact(compact_to)
    s.close()


def flip(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_compaction_drops_covered_segments_and_old_snapshots(tmp_path: Path) -> None:
    build(tmp_path, 100, [40, 80], compact_to=None)
    before = wal_files(tmp_path)
    assert len(snap_files(tmp_path)) == 2
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    s.compact(80)
    after = wal_files(tmp_path)
    assert len(after) < len(before)
    assert [p.name for p in snap_files(tmp_path)] == [f"snap-{1:020d}-{80:020d}.snap"]
    s.close()
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    assert s.snapshot == meta(80)
    assert s.entries(81, 101) == [entry(i) for i in range(81, 101)]
    assert s.hard_state == HardState(term=1, vote=1, commit=95)
    assert s.read_snapshot() == image(80)
    s.close()


def test_compacting_to_an_older_snapshot_keeps_it_and_the_wal_after_it(tmp_path: Path) -> None:
    build(tmp_path, 100, [40, 80], compact_to=40)
    assert len(snap_files(tmp_path)) == 2
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    assert s.snapshot == meta(80)
    s.close()


def test_corrupt_newest_snapshot_falls_back_to_an_older_one(tmp_path: Path) -> None:
    build(tmp_path, 100, [40, 80], compact_to=40)
    newest = snap_files(tmp_path)[-1]
    flip(newest, 20)
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    assert s.snapshot == meta(40)
    assert s.read_snapshot() == image(40)
    assert s.entries(41, 101) == [entry(i) for i in range(41, 101)]
    assert not newest.exists()
    assert newest.with_name(newest.name + ".corrupt").exists()  # kept for inspection
    s.close()


def test_corrupt_snapshot_falls_back_to_the_full_wal(tmp_path: Path) -> None:
    build(tmp_path, 30, [20], compact_to=None)
    flip(snap_files(tmp_path)[0], 3)
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    assert s.snapshot is None
    assert s.entries(1, 31) == [entry(i) for i in range(1, 31)]
    s.close()


def test_corrupt_snapshot_without_wal_behind_it_is_corruption(tmp_path: Path) -> None:
    build(tmp_path, 100, [40, 80], compact_to=80)
    flip(snap_files(tmp_path)[-1], 100)
    with pytest.raises(StorageCorruptError, match="does not continue"):
        DiskStorage.open(tmp_path)


@pytest.mark.parametrize("where", ["header", "meta", "trailer"])
def test_any_damaged_part_of_a_snapshot_is_detected(tmp_path: Path, where: str) -> None:
    build(tmp_path, 100, [40, 80], compact_to=80)
    path = snap_files(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    index = {"header": 2, "meta": 14, "trailer": len(data) - 2}[where]
    data[index] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StorageCorruptError):
        DiskStorage.open(tmp_path)


def test_streaming_out_checks_the_checksum_before_the_last_chunk(tmp_path: Path) -> None:
    build(tmp_path, 30, [20], compact_to=20)
    s = DiskStorage.open(tmp_path, segment_bytes=SEG)
    total = len(list(s.snapshot_chunks(chunk_bytes=64)))
    flip(snap_files(tmp_path)[0], 100)  # damaged after it was checked at open
    seen: list[bytes] = []
    with pytest.raises(StorageCorruptError):
        seen.extend(s.snapshot_chunks(chunk_bytes=64))
    assert len(seen) == total - 1  # the consumer never sees a "complete" bad image
    s.close()


def test_stale_temporary_snapshot_is_removed_on_open(tmp_path: Path) -> None:
    build(tmp_path, 10, [], compact_to=None)
    stale = tmp_path / "snap-00000000000000000001-00000000000000000009.snap.tmp"
    stale.write_bytes(b"half a snapshot")
    s = DiskStorage.open(tmp_path)
    assert not stale.exists()
    assert s.snapshot is None
    s.close()


def test_install_crash_before_the_wal_marker_still_empties_the_log(tmp_path: Path) -> None:
    """The snapshot file is durable but the crash came before its WAL record."""
    s = DiskStorage.open(tmp_path)
    s.save(HardState(term=3, vote=2), [entry(i) for i in range(1, 11)])
    s.close()
    wal_before = tmp_path.parent / "wal-before"
    shutil.copytree(tmp_path, wal_before)
    s = DiskStorage.open(tmp_path)
    s.save_snapshot(meta(8, term=3), b"leader state")  # disagrees with our term-1 entry 8
    s.close()
    for p in wal_files(tmp_path):
        p.unlink()
    for p in wal_files(wal_before):
        shutil.copy(p, tmp_path / p.name)
    s = DiskStorage.open(tmp_path)
    assert s.snapshot == meta(8, term=3)
    assert s.last_index() == 8
    assert s.read_snapshot() == b"leader state"
    s.close()


def test_large_image_streams_through_a_sink(tmp_path: Path) -> None:
    s = DiskStorage.open(tmp_path)
    s.save(None, [entry(1)])
    sink = s.begin_snapshot(meta(1))
    chunk = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(8):
        sink.write(chunk)
    sink.commit()
    s.close()
    s = DiskStorage.open(tmp_path)
    sizes = [len(c) for c in s.snapshot_chunks(chunk_bytes=3 << 20)]
    assert sizes == [3 << 20, 3 << 20, 2 << 20]
    assert s.read_snapshot() == chunk * 8
    s.close()
