"""One contract, two stores: every test here runs against MemoryStorage and DiskStorage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nbos.core.errors import ConfigError, ReplicationError
from nbos.core.log_storage import InitialState, LogStorage
from nbos.core.wire.raft import ConfState, Entry, HardState, SnapshotMeta
from nbos.raft.storage import (
    DiskStorage,
    InvalidLogWriteError,
    LogCompactedError,
    LogUnavailableError,
    MemoryStorage,
    NoSnapshotError,
    SnapshotOutOfDateError,
)

CONF = ConfState(voters=[1, 2, 3])


def ents(lo: int, hi: int, term: int, tag: bytes = b"") -> list[Entry]:
    """Entries lo..hi-1 of one term, each with data naming its index (and a tag)."""
    return [Entry(term=term, index=i, data=b"%d" % i + tag) for i in range(lo, hi)]


def snap(index: int, term: int) -> SnapshotMeta:
    return SnapshotMeta(index=index, term=term, conf=CONF)


class Store:
    """A store under test plus a way to restart it from what it made durable."""

    def __init__(self, open_fn: Callable[[], LogStorage], restart_fn: Callable[[], LogStorage]):
        self._restart = restart_fn
        self.s = open_fn()

    def restart(self) -> LogStorage:
        self.s = self._restart()
        return self.s


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "memory":

        def restart_memory() -> LogStorage:
            old = st.s
            assert isinstance(old, MemoryStorage)
            return old.restarted()

        st = Store(MemoryStorage, restart_memory)
    else:

        def open_disk() -> LogStorage:
            return DiskStorage.open(tmp_path, segment_bytes=512)

        def restart_disk() -> LogStorage:
            st.s.close()
            return open_disk()

        st = Store(open_disk, restart_disk)
    yield st
    st.s.close()


def assert_log(s: LogStorage, snapshot: SnapshotMeta | None, entries: list[Entry]) -> None:
    """Every query agrees with the expected snapshot and entries."""
    first = snapshot.index + 1 if snapshot else 1
    assert s.snapshot == snapshot
    assert s.first_index() == first
    assert s.last_index() == first - 1 + len(entries)
    assert s.entries(first, s.last_index() + 1) == entries
    assert s.initial_state().entries == entries
    for e in entries:
        assert s.term(e.index) == e.term
    assert s.term(first - 1) == (snapshot.term if snapshot else 0)
    with pytest.raises(LogUnavailableError):
        s.term(s.last_index() + 1)
    if snapshot:
        with pytest.raises(LogCompactedError):
            s.term(snapshot.index - 1)
        with pytest.raises(LogCompactedError):
            s.entries(snapshot.index, s.last_index() + 1)


def test_empty_store(store: Store) -> None:
    s = store.s
    assert isinstance(s, LogStorage)
    assert s.initial_state() == InitialState(HardState(), None, [])
    assert_log(s, None, [])
    assert s.entries(1, 1) == []
    with pytest.raises(NoSnapshotError):
        s.read_snapshot()
    with pytest.raises(LogUnavailableError):
        s.entries(1, 2)


def test_round_trip_and_restart(store: Store) -> None:
    hs = HardState(term=3, vote=2, commit=4)
    log = ents(1, 6, 1) + ents(6, 9, 3)
    store.s.save(hs, log[:5])
    store.s.save(None, log[5:])
    for s in (store.s, store.restart()):
        assert s.hard_state == hs
        assert_log(s, None, log)
        assert s.entries(3, 5) == log[2:4]


def test_entries_max_bytes_returns_a_prefix_but_never_nothing(store: Store) -> None:
    big = [Entry(term=1, index=i, data=bytes(100)) for i in range(1, 6)]
    store.s.save(None, big)
    assert store.s.entries(1, 6, max_bytes=1) == big[:1]
    assert store.s.entries(1, 6, max_bytes=250) == big[:2]
    assert store.s.entries(1, 6, max_bytes=10_000) == big


def test_rewrite_replaces_the_suffix(store: Store) -> None:
    store.s.save(HardState(term=1, vote=1), ents(1, 11, 1))
    store.s.save(HardState(term=2, vote=3), ents(5, 7, 2, b"new"))
    expected = ents(1, 5, 1) + ents(5, 7, 2, b"new")
    for s in (store.s, store.restart()):
        assert_log(s, None, expected)
    # A later rewrite of a rewrite, then growth past the old end.
    store.s.save(None, ents(6, 13, 2, b"again"))
    expected = ents(1, 5, 1) + ents(5, 6, 2, b"new") + ents(6, 13, 2, b"again")
    for s in (store.s, store.restart()):
        assert_log(s, None, expected)


@pytest.mark.parametrize(
    ("hs", "batch"),
    [
        (None, ents(3, 5, 1)),  # gap after index 1
        (None, [*ents(2, 3, 1), *ents(4, 5, 1)]),  # not consecutive
        (None, [Entry(term=2, index=2), Entry(term=1, index=3)]),  # term goes back
        (None, ents(2, 3, 1)),  # below the term (2) of entry 1
        (HardState(term=1), []),  # hard state term goes back
        (HardState(term=2, vote=3), []),  # second vote in term 2
    ],
)
def test_invalid_writes_are_refused_and_change_nothing(
    store: Store, hs: HardState | None, batch: list[Entry]
) -> None:
    store.s.save(HardState(term=2, vote=1), [Entry(term=2, index=1)])
    with pytest.raises(InvalidLogWriteError) as info:
        store.s.save(hs, batch)
    assert isinstance(info.value, ReplicationError)
    for s in (store.s, store.restart()):
        assert s.hard_state == HardState(term=2, vote=1)
        assert_log(s, None, [Entry(term=2, index=1)])


def test_hard_state_alone_and_vote_in_a_new_term(store: Store) -> None:
    store.s.save(HardState(term=1, vote=1), [])
    store.s.save(HardState(term=1, vote=1, commit=0), [])  # unchanged: a no-op
    store.s.save(HardState(term=4, vote=None), [])
    store.s.save(HardState(term=4, vote=2), [])
    assert store.restart().hard_state == HardState(term=4, vote=2)


def test_snapshot_compacts_a_matching_log(store: Store) -> None:
    store.s.save(HardState(term=2, vote=1, commit=8), ents(1, 6, 1) + ents(6, 11, 2))
    meta = snap(7, 2)
    store.s.save_snapshot(meta, b"image-7")
    for s in (store.s, store.restart()):
        assert_log(s, meta, ents(8, 11, 2))
        assert s.read_snapshot() == b"image-7"
        assert s.hard_state == HardState(term=2, vote=1, commit=8)
    # Entries the snapshot covers are committed: a batch overlapping it is clipped.
    store.s.save(None, ents(6, 12, 2))
    assert_log(store.s, meta, ents(8, 12, 2))


def test_snapshot_over_a_disagreeing_log_empties_it(store: Store) -> None:
    store.s.save(None, ents(1, 11, 1))
    meta = snap(8, 3)  # the leader's entry 8 is of term 3: ours (term 1) is stale
    store.s.save_snapshot(meta, b"leader")
    for s in (store.s, store.restart()):
        assert_log(s, meta, [])
    store.s.save(None, ents(9, 10, 3))
    assert_log(store.restart(), meta, ents(9, 10, 3))


def test_snapshot_beyond_the_end_of_the_log(store: Store) -> None:
    store.s.save(None, ents(1, 4, 1))
    meta = snap(20, 2)
    store.s.save_snapshot(meta, [b"a", b"b"])
    with pytest.raises(InvalidLogWriteError):
        store.s.save(None, ents(22, 23, 2))
    store.s.save(None, ents(21, 23, 2))
    for s in (store.s, store.restart()):
        assert_log(s, meta, ents(21, 23, 2))
        assert s.read_snapshot() == b"ab"


def test_older_snapshot_is_refused(store: Store) -> None:
    store.s.save(None, ents(1, 11, 1))
    store.s.save_snapshot(snap(6, 1), b"six")
    with pytest.raises(SnapshotOutOfDateError):
        store.s.save_snapshot(snap(5, 1), b"five")
    with pytest.raises(SnapshotOutOfDateError):
        store.s.begin_snapshot(snap(4, 1))
    assert store.restart().read_snapshot() == b"six"


def test_snapshot_streams_in_and_out_in_chunks(store: Store) -> None:
    image = bytes(range(256)) * 40
    store.s.save(None, ents(1, 4, 1))
    sink = store.s.begin_snapshot(snap(3, 1))
    for start in range(0, len(image), 1000):
        sink.write(image[start : start + 1000])
    assert store.s.snapshot is None  # nothing visible before commit
    sink.commit()
    for s in (store.s, store.restart()):
        chunks = list(s.snapshot_chunks(chunk_bytes=333))
        assert all(0 < len(c) <= 333 for c in chunks)
        assert b"".join(chunks) == image
    with pytest.raises(ConfigError, match="positive"):
        next(store.s.snapshot_chunks(chunk_bytes=0))


def test_aborted_snapshot_leaves_the_old_one(store: Store) -> None:
    store.s.save(None, ents(1, 6, 1))
    store.s.save_snapshot(snap(2, 1), b"two")
    sink = store.s.begin_snapshot(snap(5, 1))
    sink.write(b"five")
    sink.abort()
    sink.abort()  # idempotent
    with pytest.raises(InvalidLogWriteError):
        sink.write(b"more")
    for s in (store.s, store.restart()):
        assert_log(s, snap(2, 1), ents(3, 6, 1))
        assert s.read_snapshot() == b"two"


def test_a_sink_that_lost_the_race_to_a_newer_snapshot_is_refused(store: Store) -> None:
    store.s.save(None, ents(1, 6, 1))
    slow = store.s.begin_snapshot(snap(3, 1))
    slow.write(b"three")
    store.s.save_snapshot(snap(4, 1), b"four")
    with pytest.raises(SnapshotOutOfDateError):
        slow.commit()
    assert store.restart().read_snapshot() == b"four"


def test_compact_checks_its_bound_and_keeps_the_state(store: Store) -> None:
    store.s.save(HardState(term=1, vote=1, commit=9), ents(1, 10, 1))
    with pytest.raises(InvalidLogWriteError):
        store.s.compact(1)  # no snapshot yet
    store.s.save_snapshot(snap(6, 1), b"six")
    with pytest.raises(InvalidLogWriteError):
        store.s.compact(7)
    store.s.compact(6)
    for s in (store.s, store.restart()):
        assert_log(s, snap(6, 1), ents(7, 10, 1))
        assert s.hard_state.commit == 9
