"""The kernel's Raft state machine: which entries count, identically on every replica."""

from __future__ import annotations

from nbos.core.wire import encode
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

Entry = Claim | Done | CommEntry | bytes


class Replica:
    """A state machine fed log entries, recording what it hands to the kernel."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.machine = KernelStateMachine(self.events.append)
        self.index = 0

    def feed(self, *entries: Entry) -> list[Outcome]:
        outcomes = []
        for entry in entries:
            self.index += 1
            data = entry if isinstance(entry, bytes) else encode(entry)
            outcomes.append(decode_outcome(self.machine.apply(self.index, data)))
        return outcomes

    def committed(self) -> list[CellCommitted]:
        return [e for e in self.events if isinstance(e, CellCommitted)]


def state(cell: int, payload: bytes = b"v") -> StateDelta:
    return StateDelta(exec_index=cell, set=payload)


def done(cell: int, replica: int, count: int, status: str = "ok", payload: bytes = b"") -> Done:
    delta = state(cell, payload) if payload else None
    return Done(cell, replica, count, status, f"cell {cell}", delta)  # type: ignore[arg-type]


def test_the_first_committed_claim_wins() -> None:
    r = Replica()
    first, second = r.feed(Claim(1, 2), Claim(1, 3))
    assert first.accepted and first.winner == 2
    assert not second.accepted and second.winner == 2


def test_the_winners_done_carries_the_state_and_the_count() -> None:
    r = Replica()
    r.feed(Claim(1, 2), done(1, 2, 2, payload=b"a"))
    (cell,) = r.committed()
    assert (cell.exec_index, cell.replica, cell.status, cell.execution_count) == (1, 2, "ok", 2)
    assert cell.state is not None and cell.state.set == b"a"
    assert cell.code == "cell 1"
    assert r.machine.execution_count == 2


def test_a_lost_done_keeps_the_count_and_carries_nothing() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 1, 2), Claim(2, 1))
    (outcome,) = r.feed(done(2, 3, 99, "lost", payload=b"x"))
    assert outcome.accepted and outcome.status == "lost"
    lost = r.committed()[-1]
    assert (lost.status, lost.state, lost.code, lost.execution_count) == ("lost", None, "", 2)


def test_a_late_done_after_a_done_is_ignored() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 2, 1, "lost"))
    late, claim = r.feed(done(1, 1, 2, payload=b"late"), Claim(1, 3))
    assert not late.accepted and not claim.accepted
    assert late.status == "lost"
    assert len(r.committed()) == 1
    assert r.machine.execution_count == 1


def test_a_done_from_a_replica_that_did_not_win_carries_no_state() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 2, 5, payload=b"intruder"))
    (cell,) = r.committed()
    assert cell.state is None and cell.code == ""


def test_garbage_and_comm_entries() -> None:
    r = Replica()
    (bad,) = r.feed(b"\x00not an entry")
    assert not bad.accepted
    r.feed(CommEntry(2, b'{"header": {}}', [b"buf"]))
    assert r.events == [CommDelivered(2, 2, b'{"header": {}}', (b"buf",))]


def test_replicas_fed_the_same_log_agree_even_with_duplicates() -> None:
    log: list[Entry] = [
        Claim(1, 1), Claim(1, 2), done(1, 1, 2, payload=b"a"), done(1, 2, 2, payload=b"b"),
        Claim(2, 2), done(2, 3, 2, "lost"), done(2, 2, 3, payload=b"c"),
        Claim(3, 3), done(3, 3, 3, "error"),
    ]  # fmt: skip
    a, b = Replica(), Replica()
    assert a.feed(*log) == b.feed(*log)
    assert a.events == b.events
    assert a.machine.snapshot() == b.machine.snapshot()
    assert [(c.exec_index, c.status) for c in a.committed()] == [
        (1, "ok"),
        (2, "lost"),
        (3, "error"),
    ]


def test_snapshot_restores_counters_image_and_replay() -> None:
    a = Replica()
    a.feed(Claim(1, 1), done(1, 1, 2, payload=b"one"))
    a.machine.rebase(1, b"image-after-1")
    a.feed(Claim(2, 2), done(2, 2, 3, payload=b"two"), Claim(3, 1))
    b = Replica()
    b.machine.restore(a.machine.snapshot())
    (restored,) = b.events
    assert isinstance(restored, Restored)
    assert restored.namespace == b"image-after-1"
    assert [d.set for d in restored.deltas] == [b"two"]
    assert (restored.last_done, restored.execution_count) == (2, 3)
    # The claim of cell 3 survives the snapshot: its winner's Done still counts.
    b.feed(done(3, 1, 4, payload=b"three"))
    last = b.committed()[-1]
    assert last.state is not None and last.state.set == b"three"


def test_rebase_ignores_stale_or_future_images() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 1, 2, payload=b"a"), Claim(2, 1), done(2, 1, 3, payload=b"b"))
    assert r.machine.replay_bytes == 2
    r.machine.rebase(5, b"future")  # cell 5 has not committed
    assert r.machine.replay_bytes == 2
    r.machine.rebase(2, b"now")
    assert r.machine.replay_bytes == 0
    r.machine.rebase(1, b"older")  # never goes back
    restored = Replica()
    restored.machine.restore(r.machine.snapshot())
    assert isinstance(restored.events[0], Restored)
    assert restored.events[0].namespace == b"now"


def test_a_snapshot_that_does_not_decode_is_ignored() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 1, 2))
    r.machine.restore(b"garbage")
    assert r.machine.last_done == 1 and r.machine.execution_count == 2


def next_claimed(cell: int, replica: int, count: int, status: str = "ok") -> Done:
    return Done(cell, replica, count, status, claim_next=True)  # type: ignore[arg-type]


def test_a_done_that_counts_claims_the_next_cell_for_its_replica() -> None:
    r = Replica()
    _, carried = r.feed(Claim(1, 2), next_claimed(1, 2, 2))
    assert carried.accepted and carried.winner == 2
    assert r.machine.claim_stands(2, 2)
    assert r.machine.progress() == (1, 2)
    # Another replica sent cell 2 after all: its claim loses to the carried one.
    (late,) = r.feed(Claim(2, 3))
    assert not late.accepted and late.winner == 2
    # The carried claim counts as any claim: the winner's Done has its state.
    r.feed(Done(2, 2, 3, "ok", "", state(2, b"two")))
    last = r.committed()[-1]
    assert last.counts and last.state is not None and last.state.set == b"two"


def test_a_done_that_does_not_count_claims_nothing() -> None:
    r = Replica()
    # Replica 3 did not win cell 1, and a lost Done is no executor's.
    _, intruder, lost = r.feed(Claim(1, 2), next_claimed(1, 3, 2), next_claimed(2, 1, 2, "lost"))
    assert intruder.accepted and intruder.winner == -1
    assert lost.accepted and lost.winner == -1
    assert not r.machine.claim_stands(2, 3) and not r.machine.claim_stands(3, 1)
    (claim,) = r.feed(Claim(3, 1))
    assert claim.accepted and claim.winner == 1


def test_a_done_refused_as_late_claims_nothing() -> None:
    r = Replica()
    r.feed(Claim(1, 1), done(1, 2, 1, "lost"))
    (late,) = r.feed(next_claimed(1, 1, 2))
    assert not late.accepted
    (claim,) = r.feed(Claim(2, 3))
    assert claim.accepted and claim.winner == 3


def test_a_claim_committed_before_the_done_keeps_the_next_cell() -> None:
    r = Replica()
    r.feed(Claim(1, 1), Claim(2, 3))
    (carried,) = r.feed(next_claimed(1, 1, 2))
    assert carried.accepted and carried.winner == 3
    assert r.machine.claim_stands(2, 3) and not r.machine.claim_stands(2, 1)


def test_a_carried_claim_survives_a_snapshot() -> None:
    a = Replica()
    a.feed(Claim(1, 1), next_claimed(1, 1, 2))
    b = Replica()
    b.machine.restore(a.machine.snapshot())
    assert b.machine.claim_stands(2, 1)
