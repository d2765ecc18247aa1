"""The kernel's Raft state machine: which entries count, identically on every replica."""

from __future__ import annotations

from nbos.core.wire import decode, encode
from nbos.core.wire.entries import Claim, CommEntry, Done
from nbos.core.wire.state import StateDelta
from nbos.kernel.replica import KernelStateMachine
from nbos.kernel.replica._machine import (
    CellCommitted,
    CommDelivered,
    Event,
    Outcome,
    Restored,
    decode_outcome,
)


class Replica:
    """A state machine fed log entries, recording what it hands to the kernel."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.machine = KernelStateMachine(self.events.append)
        self.index = 0

    def feed(self, *entries: Claim | Done | CommEntry | StateDelta | bytes) -> list[Outcome]:
        outcomes = []
        for entry in entries:
            self.index += 1
            data = entry if isinstance(entry, bytes) else encode(entry)
            outcomes.append(decode_outcome(self.machine.apply(self.index, data)))
        return outcomes

    def committed(self) -> list[CellCommitted]:
        return [e for e in self.events if isinstance(e, CellCommitted)]


def delta(cell: int, payload: bytes = b"v") -> StateDelta:
    return StateDelta(exec_index=cell, set=payload)


def test_the_first_committed_claim_wins() -> None:
    r = Replica()
    first, second = r.feed(Claim(1, 2), Claim(1, 3))
    assert first.accepted and first.winner == 2
    assert not second.accepted and second.winner == 2


def test_state_takes_effect_with_the_winners_done() -> None:
    r = Replica()
    r.feed(Claim(1, 2), delta(1, b"a"), delta(1, b"b"))
    assert r.committed() == []
    r.feed(Done(1, 2, 2, "ok"))
    (cell,) = r.committed()
    assert (cell.exec_index, cell.replica, cell.status, cell.execution_count) == (1, 2, "ok", 2)
    assert [set_of(d) for d in cell.deltas] == [b"a", b"b"]


def set_of(data: bytes) -> bytes:
    entry = decode(data)
    assert isinstance(entry, StateDelta)
    return entry.set


def test_a_lost_done_drops_the_cells_state_and_keeps_the_count() -> None:
    r = Replica()
    r.feed(Claim(1, 1), Done(1, 1, 2, "ok"), Claim(2, 1), delta(2))
    (outcome,) = r.feed(Done(2, 3, 99, "lost"))
    assert outcome.accepted and outcome.status == "lost"
    lost = r.committed()[-1]
    assert lost.status == "lost" and lost.deltas == () and lost.execution_count == 2


def test_late_state_and_done_after_a_done_are_ignored() -> None:
    r = Replica()
    r.feed(Claim(1, 1), Done(1, 2, 1, "lost"))
    state, done, claim = r.feed(delta(1), Done(1, 1, 2, "ok"), Claim(1, 3))
    assert not state.accepted and not done.accepted and not claim.accepted
    assert done.status == "lost"
    assert len(r.committed()) == 1
    assert r.machine.execution_count == 1


def test_state_for_an_unclaimed_cell_is_ignored() -> None:
    r = Replica()
    (state,) = r.feed(delta(5))
    assert not state.accepted
    r.feed(Claim(5, 1), Done(5, 1, 2, "ok"))
    assert r.committed()[0].deltas == ()


def test_a_done_from_a_replica_that_did_not_win_carries_no_state() -> None:
    r = Replica()
    r.feed(Claim(1, 1), delta(1), Done(1, 2, 5, "ok"))
    assert r.committed()[0].deltas == ()


def test_garbage_and_comm_entries() -> None:
    r = Replica()
    (bad,) = r.feed(b"\x00not an entry")
    assert not bad.accepted
    r.feed(CommEntry(2, b'{"header": {}}', [b"buf"]))
    assert r.events == [CommDelivered(2, 2, b'{"header": {}}', (b"buf",))]


def test_replicas_fed_the_same_log_agree_even_with_duplicates() -> None:
    log: list[Claim | Done | CommEntry | StateDelta | bytes] = [
        Claim(1, 1), delta(1), Claim(1, 2), Done(1, 1, 2, "ok"), Done(1, 2, 2, "ok"),
        Claim(2, 2), delta(2), Done(2, 3, 2, "lost"), delta(2), Claim(3, 3), Done(3, 3, 3, "error"),
    ]  # fmt: skip
    a, b = Replica(), Replica()
    assert a.feed(*log) == b.feed(*log)
    assert a.events == b.events
    assert a.machine.snapshot() == b.machine.snapshot()
    assert [c.exec_index for c in a.committed()] == [1, 2, 3]


def test_snapshot_restores_counters_image_and_replay() -> None:
    a = Replica()
    a.feed(Claim(1, 1), delta(1, b"one"), Done(1, 1, 2, "ok"))
    a.machine.rebase(1, b"image-after-1")
    a.feed(Claim(2, 2), delta(2, b"two"), Done(2, 2, 3, "ok"), Claim(3, 1), delta(3, b"three"))
    b = Replica()
    b.machine.restore(a.machine.snapshot())
    (restored,) = b.events
    assert isinstance(restored, Restored)
    assert restored.namespace == b"image-after-1"
    assert [set_of(d) for d in restored.deltas] == [b"two"]
    assert (restored.last_done, restored.execution_count) == (2, 3)
    # The pending state of cell 3 survives the snapshot and counts when its Done commits.
    b.feed(Done(3, 1, 4, "ok"))
    assert [set_of(d) for d in b.committed()[-1].deltas] == [b"three"]


def test_rebase_ignores_stale_or_future_images() -> None:
    r = Replica()
    r.feed(Claim(1, 1), delta(1), Done(1, 1, 2, "ok"), Claim(2, 1), delta(2), Done(2, 1, 3, "ok"))
    size = r.machine.replay_bytes
    r.machine.rebase(5, b"future")  # cell 5 has not committed
    assert r.machine.replay_bytes == size
    r.machine.rebase(2, b"now")
    assert r.machine.replay_bytes == 0
    r.machine.rebase(1, b"older")  # never goes back
    restored = Replica()
    restored.machine.restore(r.machine.snapshot())
    assert isinstance(restored.events[0], Restored)
    assert restored.events[0].namespace == b"now"


def test_a_snapshot_that_does_not_decode_is_ignored() -> None:
    r = Replica()
    r.feed(Claim(1, 1), Done(1, 1, 2, "ok"))
    r.machine.restore(b"garbage")
    assert r.machine.last_done == 1 and r.machine.execution_count == 2
