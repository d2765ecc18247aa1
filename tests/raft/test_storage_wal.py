"""DiskStorage's WAL: segment rotation, torn tails, corruption, locking, fsync policy."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nbos.core.errors import ConfigError, StorageCorruptError
from nbos.core.wire.raft import Entry, HardState
from nbos.raft.storage import DEFAULT_SEGMENT_BYTES, DiskStorage, StorageIOError
from nbos.raft.storage._framing import MAGIC
from nbos.raft.storage._segments import PREALLOCATE_BYTES
from tests.raft._wal import written

SEGMENT_NAME = re.compile(r"^wal-(\d{20})-(\d{20})\.log$")


def entry(i: int, term: int = 1) -> Entry:
    return Entry(term=term, index=i, data=b"payload-%d" % i)


def segments(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if SEGMENT_NAME.match(p.name))


def one_by_one(d: Path, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> list[int]:
    """Saves entries 1..n one batch (and one record) each; returns the segment size after each."""
    s = DiskStorage.open(d, segment_bytes=segment_bytes)
    s.save(HardState(term=1, vote=1), [])
    sizes = []
    for i in range(1, n + 1):
        s.save(None, [entry(i)])
        sizes.append(written(segments(d)[-1]))
    s.close()
    return sizes


@pytest.fixture
def five(tmp_path: Path) -> tuple[Path, list[int]]:
    """A directory holding entries 1..5 in one segment, and each save's end offset."""
    d = tmp_path / "orig"
    return d, one_by_one(d, 5)


def damaged_copy(src: Path, dst: Path) -> Path:
    """A copy of ``src``; returns the path of its last segment, to be damaged."""
    shutil.copytree(src, dst)
    return segments(dst)[-1]


def last_record_offsets(sizes: list[int]) -> range:
    return range(sizes[-2], sizes[-1])


def test_rotation_spreads_the_log_over_named_segments(tmp_path: Path) -> None:
    one_by_one(tmp_path, 60, segment_bytes=300)
    names = [SEGMENT_NAME.match(p.name) for p in segments(tmp_path)]
    assert len(names) > 5
    seqs = [int(m.group(1)) for m in names if m]
    firsts = [int(m.group(2)) for m in names if m]
    assert seqs == list(range(1, len(seqs) + 1))
    assert firsts == sorted(firsts) and firsts[0] == 1
    s = DiskStorage.open(tmp_path, segment_bytes=300)
    assert s.entries(1, 61) == [entry(i) for i in range(1, 61)]
    assert s.hard_state == HardState(term=1, vote=1)
    s.close()


def test_rewrite_across_segments_survives_restart(tmp_path: Path) -> None:
    s = DiskStorage.open(tmp_path, segment_bytes=200)
    s.save(None, [entry(i) for i in range(1, 31)])
    for i in range(10, 20):
        s.save(HardState(term=2), [entry(i, term=2)])
    s.close()
    assert len(segments(tmp_path)) > 3
    s = DiskStorage.open(tmp_path, segment_bytes=200)
    assert s.entries(1, s.last_index() + 1) == [entry(i) for i in range(1, 10)] + [
        entry(i, term=2) for i in range(10, 20)
    ]
    s.close()


def test_torn_tail_is_cut_at_every_offset(five: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, sizes = five
    for cut in last_record_offsets(sizes):
        seg = damaged_copy(src, tmp_path / f"cut{cut}")
        os.truncate(seg, cut)
        s = DiskStorage.open(seg.parent)
        assert s.entries(1, s.last_index() + 1) == [entry(i) for i in range(1, 5)], cut
        assert seg.stat().st_size == sizes[-2]
        s.close()


@pytest.mark.parametrize("damage", ["flip", "zeros"])
def test_garbage_in_the_last_record_is_a_torn_tail(
    five: tuple[Path, list[int]], tmp_path: Path, damage: str
) -> None:
    src, sizes = five
    for offset in last_record_offsets(sizes):
        seg = damaged_copy(src, tmp_path / f"{damage}{offset}")
        data = bytearray(seg.read_bytes())
        if damage == "flip":
            data[offset] ^= 0xFF
        else:  # a power loss can leave zeroed pages after the last good write
            data[offset:] = bytes(len(data) - offset + 4096)
        seg.write_bytes(bytes(data))
        s = DiskStorage.open(seg.parent)
        assert s.last_index() == 4, offset
        s.close()


def test_a_torn_record_holding_frame_bytes_is_still_torn(
    five: tuple[Path, list[int]], tmp_path: Path
) -> None:
    src, sizes = five
    framed = segments(src)[-1].read_bytes()[sizes[1] : sizes[2]]  # a whole valid frame
    d = tmp_path / "d"
    s = DiskStorage.open(d)
    s.save(None, [entry(1)])
    before = written(segments(d)[-1])
    s.save(None, [Entry(term=1, index=2, data=framed * 3)])
    s.close()
    os.truncate(segments(d)[-1], before + 100 + 2 * len(framed))  # cut after 2 embedded frames
    s = DiskStorage.open(d)
    assert s.last_index() == 1
    s.close()


def test_after_a_cut_the_log_grows_again(five: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, sizes = five
    seg = damaged_copy(src, tmp_path / "d")
    os.truncate(seg, sizes[-1] - 3)
    s = DiskStorage.open(seg.parent)
    s.save(None, [entry(5, term=2), entry(6, term=2)])
    s.close()
    s = DiskStorage.open(seg.parent)
    assert s.entries(1, 7) == [entry(i) for i in range(1, 5)] + [entry(5, 2), entry(6, 2)]
    s.close()


def test_damage_mid_log_is_corruption_naming_file_and_offset(
    five: tuple[Path, list[int]], tmp_path: Path
) -> None:
    src, sizes = five
    record_start, record_end = sizes[1], sizes[2]  # the third entry, two follow it
    for offset in range(record_start, record_end):
        seg = damaged_copy(src, tmp_path / f"mid{offset}")
        data = bytearray(seg.read_bytes())
        data[offset] ^= 0x55
        seg.write_bytes(bytes(data))
        with pytest.raises(StorageCorruptError) as info:
            DiskStorage.open(seg.parent)
        assert str(seg) in str(info.value)
        assert f"offset {record_start}" in str(info.value)
        assert seg.stat().st_size == sizes[-1]  # nothing was cut


def test_a_checksummed_but_undecodable_tail_is_corruption(
    five: tuple[Path, list[int]], tmp_path: Path
) -> None:
    src, _ = five
    seg = damaged_copy(src, tmp_path / "d")
    payload = b"\xc1"  # a byte msgpack never uses
    prefix = b"\xd5NbW" + struct.pack("<II", len(payload), zlib.crc32(payload))
    frame = prefix + struct.pack("<I", zlib.crc32(prefix))
    with seg.open("ab") as f:
        f.write(frame + payload)
    with pytest.raises(StorageCorruptError, match="undecodable"):
        DiskStorage.open(seg.parent)


@pytest.mark.parametrize("damage", ["truncate", "flip_last_byte"])
def test_damage_in_an_older_segment_is_corruption(tmp_path: Path, damage: str) -> None:
    one_by_one(tmp_path, 30, segment_bytes=300)
    older = segments(tmp_path)[1]
    if damage == "truncate":
        os.truncate(older, older.stat().st_size - 1)
    else:
        data = bytearray(older.read_bytes())
        data[-1] ^= 1
        older.write_bytes(bytes(data))
    with pytest.raises(StorageCorruptError, match=re.escape(str(older))):
        DiskStorage.open(tmp_path)


def test_a_missing_segment_is_corruption(tmp_path: Path) -> None:
    one_by_one(tmp_path, 30, segment_bytes=300)
    segments(tmp_path)[2].unlink()
    with pytest.raises(StorageCorruptError, match="missing"):
        DiskStorage.open(tmp_path)


def test_a_directory_is_opened_by_one_store_at_a_time(tmp_path: Path) -> None:
    s = DiskStorage.open(tmp_path)
    with pytest.raises(StorageIOError, match="cannot open"):
        DiskStorage.open(tmp_path)
    s.close()
    DiskStorage.open(tmp_path).close()


def test_closed_store_refuses_writes(tmp_path: Path) -> None:
    s = DiskStorage.open(tmp_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(StorageIOError, match="closed"):
        s.save(None, [entry(1)])


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts real fsync and fdatasync calls (they still happen)."""
    calls: list[int] = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def counting(fd: int, real: Callable[[int], None] = real) -> None:
            calls.append(fd)
            real(fd)

        monkeypatch.setattr(os, name, counting)
    yield calls


@pytest.mark.parametrize(
    ("policy", "syncs_for_entries", "syncs_for_commit_only"),
    [("always", 1, 1), ("batch", 1, 0), ("never", 0, 0)],
)
def test_fsync_policy(
    tmp_path: Path,
    fsyncs: list[int],
    policy: str,
    syncs_for_entries: int,
    syncs_for_commit_only: int,
) -> None:
    s = DiskStorage.open(tmp_path, fsync=policy)  # type: ignore[arg-type]
    fsyncs.clear()
    s.save(HardState(term=1, vote=1), [entry(1)])
    assert len(fsyncs) == syncs_for_entries
    fsyncs.clear()
    s.save(HardState(term=1, vote=1, commit=1), [])
    assert len(fsyncs) == syncs_for_commit_only
    fsyncs.clear()
    s.save(HardState(term=2, vote=None, commit=1), [])  # a new term must be durable
    assert len(fsyncs) == syncs_for_entries
    s.close()
    s = DiskStorage.open(tmp_path)
    assert s.hard_state == HardState(term=2, vote=None, commit=1)
    s.close()


_DISK_FULL = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from nbos.core.wire.raft import Entry
    from nbos.raft.storage import DEFAULT_SEGMENT_BYTES, DiskStorage, StorageIOError

    s = DiskStorage.open(sys.argv[1])
    s.save(None, [Entry(term=1, index=1, data=b"kept")])
    from nbos.raft.storage._framing import scan
    segment = max(Path(sys.argv[1]).glob("wal-*.log"))
    print("size before", scan(segment.read_bytes()).valid_end)  # the records, not the zeros after
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    for attempt in range(2):
        try:
            s.save(None, [Entry(term=1, index=2, data=bytes(8192))])
        except StorageIOError as exc:
            print("refused", attempt, exc)
    print("size after", segment.stat().st_size)
    """
)


def test_a_failed_write_is_cut_back_and_the_store_refuses_more(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "refused 0" in done.stdout and "refused 1" in done.stdout
    assert "failed earlier" in done.stdout
    sizes = re.findall(r"size (?:before|after) (\d+)", done.stdout)
    assert len(sizes) == 2 and sizes[0] == sizes[1]  # the partial frame was cut back out
    s = DiskStorage.open(tmp_path)  # no partial frame was left: opens cleanly
    assert s.entries(1, s.last_index() + 1) == [Entry(term=1, index=1, data=b"kept")]
    s.close()


@pytest.mark.parametrize(
    ("key", "kwargs"), [("segment_bytes", {"segment_bytes": 0}), ("fsync", {"fsync": "sometimes"})]
)
def test_bad_settings_are_config_errors(
    tmp_path: Path, key: str, kwargs: dict[str, object]
) -> None:
    with pytest.raises(ConfigError) as info:
        DiskStorage.open(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert info.value.key == key


# --- segments allocated ahead of their writes --------------------------------------

_CRASH_AFTER_SAVES = textwrap.dedent(
    """
    import os, sys
    from nbos.core.wire.raft import Entry, HardState
    from nbos.raft.storage import DiskStorage

    s = DiskStorage.open(sys.argv[1])
    s.save(HardState(term=1, vote=1), [])
    for i in range(1, 6):
        s.save(None, [Entry(term=1, index=i, data=b"payload-%d" % i)])
    os._exit(0)  # no close: the open segment keeps its allocated tail
    """
)


def crash_after_five_saves(d: Path) -> Path:
    """A store in ``d`` left by a process that died after saving entries 1..5."""
    subprocess.run([sys.executable, "-c", _CRASH_AFTER_SAVES, str(d)], check=True, timeout=60)
    (segment,) = segments(d)
    return segment


def test_the_open_segment_is_allocated_ahead_and_cut_back_when_closed(tmp_path: Path) -> None:
    s = DiskStorage.open(tmp_path, segment_bytes=256)
    for i in range(1, 30):
        s.save(None, [entry(i)])
    *older, current = segments(tmp_path)
    assert older, "the test needs rotated segments"
    assert current.stat().st_size >= PREALLOCATE_BYTES > written(current)
    # Cut back when they were rotated out: zeros in an older segment would be corruption.
    assert all(p.stat().st_size == written(p) for p in older)
    s.close()
    assert current.stat().st_size == written(current)
    s = DiskStorage.open(tmp_path, segment_bytes=256)
    assert s.entries(1, 30) == [entry(i) for i in range(1, 30)]
    s.close()


def test_the_allocated_tail_a_crash_left_is_cut_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segment = crash_after_five_saves(tmp_path)
    assert segment.stat().st_size >= PREALLOCATE_BYTES
    with caplog.at_level(logging.DEBUG, logger="nbos.raft.storage"):
        s = DiskStorage.open(tmp_path)
    assert s.entries(1, 6) == [entry(i) for i in range(1, 6)]
    s.close()
    assert segment.stat().st_size == written(segment)
    cuts = [r for r in caplog.records if "cutting" in r.getMessage()]
    assert [(r.levelno, "unwritten" in r.getMessage()) for r in cuts] == [(logging.DEBUG, True)]


def test_a_torn_record_in_the_allocated_tail_is_still_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segment = crash_after_five_saves(tmp_path)
    end = written(segment)
    with segment.open("r+b") as f:  # the first bytes of a sixth frame, then the zeros
        f.seek(end)
        f.write(MAGIC + b"\x07\x00")
    with caplog.at_level(logging.WARNING, logger="nbos.raft.storage"):
        s = DiskStorage.open(tmp_path)
    assert s.entries(1, 6) == [entry(i) for i in range(1, 6)]
    s.close()
    assert segment.stat().st_size == end
    assert any("torn tail" in r.getMessage() for r in caplog.records)


def refuse_allocation(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse)


def test_a_file_system_that_cannot_allocate_ahead_gets_plain_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_allocation(monkeypatch, errno.EOPNOTSUPP)
    s = DiskStorage.open(tmp_path)
    for i in range(1, 6):
        s.save(None, [entry(i)])
        (segment,) = segments(tmp_path)
        assert segment.stat().st_size == written(segment)
    s.close()
    s = DiskStorage.open(tmp_path)
    assert s.entries(1, 6) == [entry(i) for i in range(1, 6)]
    s.close()


def test_a_full_disk_at_allocation_fails_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = DiskStorage.open(tmp_path)
    s.save(None, [entry(1)])
    refuse_allocation(monkeypatch, errno.ENOSPC)
    with pytest.raises(StorageIOError):
        s.save(None, [entry(2, term=1), Entry(term=1, index=3, data=bytes(2 << 20))])
    with pytest.raises(StorageIOError, match="failed earlier"):
        s.save(None, [entry(2)])
    s.close()
    monkeypatch.undo()
    s = DiskStorage.open(tmp_path)
    assert s.entries(1, s.last_index() + 1) == [entry(1)]
    s.close()
