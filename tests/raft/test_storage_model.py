"""Hypothesis: random save/rewrite/snapshot/compact/restart sequences against a plain model.

Both stores run the same sequence; after every step every query must agree with
a deliberately naive model (a dict of entries and the Raft snapshot rule).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nbos.core.log_storage import LogStorage
from nbos.core.wire.raft import ConfState, Entry, HardState, SnapshotMeta
from nbos.raft.storage import (
    DiskStorage,
    InvalidLogWriteError,
    LogCompactedError,
    LogUnavailableError,
    MemoryStorage,
)
from tests.raft._wal import written

EXAMPLES = int(os.environ.get("NBOS_STORAGE_EXAMPLES", "40"))
STEPS = int(os.environ.get("NBOS_STORAGE_STEPS", "30"))


class Model:
    """What the log should be: the snapshot position, a dict of entries after it, hard state."""

    def __init__(self) -> None:
        self.hard_state = HardState()
        self.snap: SnapshotMeta | None = None
        self.image = b""
        self.log: dict[int, Entry] = {}

    @property
    def snap_index(self) -> int:
        return self.snap.index if self.snap else 0

    @property
    def last(self) -> int:
        return max(self.log, default=self.snap_index)

    def term(self, index: int) -> int:
        if index == self.snap_index:
            return self.snap.term if self.snap else 0
        return self.log[index].term

    def clone(self) -> Model:
        twin = Model()
        twin.hard_state, twin.snap, twin.image, twin.log = (
            self.hard_state,
            self.snap,
            self.image,
            dict(self.log),
        )
        return twin

    def save(self, hs: HardState | None, entries: list[Entry]) -> None:
        for e in entries:
            if e.index <= self.snap_index:
                continue
            self.log = {i: x for i, x in self.log.items() if i < e.index}
            self.log[e.index] = e
        if hs is not None:
            self.hard_state = hs

    def snapshot(self, meta: SnapshotMeta, image: bytes) -> None:
        agrees = self.snap_index <= meta.index <= self.last and self.term(meta.index) == meta.term
        self.log = {i: e for i, e in self.log.items() if i > meta.index} if agrees else {}
        self.snap, self.image = meta, image


@dataclass
class LastBatch:
    """The last save, while its bytes are still the tail of the last segment."""

    before: Model
    entries: list[Entry]
    segment: Path
    start: int
    end: int


class StorageMachine(RuleBasedStateMachine):
    disk = True

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="nbos-storage-model-")
        self.model = Model()
        self.store: LogStorage = self._open() if self.disk else MemoryStorage()
        self.last_batch: LastBatch | None = None

    def _tail(self) -> tuple[Path, int] | None:
        if not self.disk:
            return None
        last = max(Path(self.dir).glob("wal-*.log"))
        return last, written(last)

    def _open(self) -> DiskStorage:
        return DiskStorage.open(self.dir, fsync="never", segment_bytes=256)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(data=st.data(), n=st.integers(0, 5), bump=st.integers(0, 2), with_hs=st.booleans())
    def save(self, data: st.DataObject, n: int, bump: int, with_hs: bool) -> None:
        m = self.model
        start = data.draw(st.integers(m.snap_index + 1, m.last + 1), label="start")
        term = max(m.term(start - 1), m.hard_state.term) + bump
        payload = data.draw(st.binary(max_size=40), label="payload")
        entries = [Entry(term=term, index=i, data=payload) for i in range(start, start + n)]
        hs = None
        if with_hs:
            new_term = max(term, m.hard_state.term)
            keep_vote = new_term == m.hard_state.term and m.hard_state.vote is not None
            vote = m.hard_state.vote if keep_vote else data.draw(st.sampled_from([None, 1, 2, 3]))
            hs = HardState(term=new_term, vote=vote, commit=data.draw(st.integers(0, m.last)))
        before, tail = m.clone(), self._tail()
        self.store.save(hs, entries)
        m.save(hs, entries)
        after = self._tail()
        self.last_batch = None
        if tail and after and tail[0] == after[0] and after[1] > tail[1]:
            self.last_batch = LastBatch(before, entries, tail[0], tail[1], after[1])

    @precondition(lambda self: self.last_batch is not None)
    @rule(data=st.data())
    def crash_tearing_the_last_batch(self, data: st.DataObject) -> None:
        """Cut the last batch anywhere: the store comes back with a prefix of it."""
        batch = self.last_batch
        assert batch is not None
        cut = data.draw(st.integers(batch.start, batch.end - 1), label="cut at")
        self.store.close()
        os.truncate(batch.segment, cut)
        self.store = self._open()
        self.last_batch = None
        candidates = [batch.before.clone() for _ in range(len(batch.entries) + 1)]
        for n, candidate in enumerate(candidates):
            candidate.save(None, batch.entries[:n])
        for candidate in candidates:
            if _same(self.store, candidate):
                self.model = candidate
                return
        raise AssertionError("after a torn batch the log is not a prefix of that batch")

    @rule(skip=st.integers(2, 4))
    def save_with_a_gap_is_refused(self, skip: int) -> None:
        self.last_batch = None
        bad = [Entry(term=self.model.hard_state.term + 1, index=self.model.last + skip)]
        try:
            self.store.save(None, bad)
        except InvalidLogWriteError:
            return
        raise AssertionError("a gap was accepted")

    @rule(data=st.data(), disagree=st.booleans(), chunks=st.lists(st.binary(max_size=30)))
    def snapshot(self, data: st.DataObject, disagree: bool, chunks: list[bytes]) -> None:
        self.last_batch = None
        m = self.model
        index = data.draw(st.integers(m.snap_index, m.last + 3), label="snap index")
        term = m.term(index) if index <= m.last else m.term(m.last)
        meta = SnapshotMeta(index=index, term=term + disagree, conf=ConfState(voters=[1, 2, 3]))
        self.store.save_snapshot(meta, chunks)
        m.snapshot(meta, b"".join(chunks))

    @precondition(lambda self: self.model.snap is not None)
    @rule(data=st.data())
    def compact(self, data: st.DataObject) -> None:
        self.last_batch = None
        self.store.compact(data.draw(st.integers(0, self.model.snap_index), label="upto"))

    @rule()
    def restart(self) -> None:
        self.last_batch = None
        if isinstance(self.store, MemoryStorage):
            self.store = self.store.restarted()
        else:
            self.store.close()
            self.store = self._open()

    @invariant()
    def agrees_with_model(self) -> None:
        s, m = self.store, self.model
        assert s.hard_state == m.hard_state
        assert s.snapshot == m.snap
        assert s.first_index() == m.snap_index + 1
        assert s.last_index() == m.last
        expected = [m.log[i] for i in sorted(m.log)]
        assert s.entries(m.snap_index + 1, m.last + 1) == expected
        assert s.initial_state().entries == expected
        assert s.term(m.snap_index) == m.term(m.snap_index)
        for e in expected:
            assert s.term(e.index) == e.term
        if m.snap is not None:
            assert s.read_snapshot() == m.image
            if m.snap_index > 0:
                _raises(LogCompactedError, lambda: s.term(m.snap_index - 1))
        _raises(LogUnavailableError, lambda: s.term(m.last + 1))


def _same(s: LogStorage, m: Model) -> bool:
    return (
        s.hard_state == m.hard_state
        and s.last_index() == m.last
        and s.entries(s.first_index(), s.last_index() + 1) == [m.log[i] for i in sorted(m.log)]
    )


def _raises(kind: type[Exception], call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except kind:
        return
    raise AssertionError(f"expected {kind.__name__}")


class MemoryStorageMachine(StorageMachine):
    disk = False


_settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS)
TestDiskStorageModel = StorageMachine.TestCase
TestDiskStorageModel.settings = _settings
TestMemoryStorageModel = MemoryStorageMachine.TestCase
TestMemoryStorageModel.settings = _settings
