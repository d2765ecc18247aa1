"""The checks run after each fault: pure functions of what the client recorded and read.

Each returns the :class:`Violation` s it found; none means the property held.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

import attrs

from nbos.chaos._workload import CellRecord, Observed


@attrs.frozen
class Violation:
    """A broken promise: ``kind`` names the property, ``detail`` the evidence."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


#: The invariants a report shows, each with what it promises and the violation kinds
#: that break it.
INVARIANTS: dict[str, tuple[str, frozenset[str]]] = {
    "defined-outcome": (
        "every cell ends ok, lost or of no known outcome; execution_count only grows",
        frozenset({"outcome", "execution-count"}),
    ),
    "exactly-once": (
        "no acknowledged cell lost or run twice, no lost cell applied",
        frozenset(
            {
                "exactly-once",
                "lost-applied",
                "ran-after-lost",
                "ran-twice",
                "torn-cell",
                "order",
                "phantom",
                "unreadable",
            }
        ),
    ),
    "replicas-agree": (
        "back to full strength, every live replica holds the same namespace",
        frozenset({"diverged", "unsettled", "degraded"}),
    ),
    "recovers": ("a cell is ok again within recovery_s", frozenset({"no-recovery"})),
    "no-healthy-kernel-dead": (
        "every kernel started and not shut down is listed, runs a cell and holds every "
        "acknowledged append",
        frozenset({"kernel-dead", "kernel-state"}),
    ),
    "control-input": (
        "a malformed control request is refused with ControlError; the gateway goes on",
        frozenset({"control-input", "gateway-down"}),
    ),
    "durable-start": (
        "a kernel start is acknowledged only once the gateway's state holding it is on disk",
        frozenset({"not-durable"}),
    ),
}


def invariant_of(violation: Violation) -> str:
    """The name of the invariant ``violation`` breaks (``other`` for a kind of none)."""
    return next(
        (name for name, (_, kinds) in INVARIANTS.items() if violation.kind in kinds), "other"
    )


def check_outcomes(history: Sequence[CellRecord]) -> list[Violation]:
    """Every cell got a defined answer (ok, lost, or no outcome yet for want of a majority):
    the kernel never leaves a client guessing."""
    return [
        Violation("outcome", f"cell {r.seq} ended with {r.ename}, not an answer the kernel defines")
        for r in history
        if r.outcome == "unknown"
    ]


def check_effects(history: Sequence[CellRecord], observed: Observed) -> list[Violation]:
    """Acknowledged cells applied exactly once, lost ones never, unknown ones at most once.

    Also: ``n`` counts ``L`` (a cell's two effects go together) and ``L`` is in the
    order the cells were sent (cells run one at a time).
    """
    applied = Counter(observed.appended)
    found: list[Violation] = []
    for r in history:
        times = applied.pop(r.seq, 0)
        if r.outcome == "ok" and times != 1:
            found.append(Violation("exactly-once", f"acknowledged cell {r.seq} applied {times}x"))
        elif r.outcome == "lost" and times:
            found.append(Violation("lost-applied", f"cell {r.seq} ({r.ename}) applied {times}x"))
        elif r.outcome in ("indeterminate", "unknown") and times > 1:
            found.append(Violation("exactly-once", f"cell {r.seq} ({r.ename}) applied {times}x"))
    found += [Violation("phantom", f"cell {seq} was never sent") for seq in sorted(applied)]
    if observed.n != len(observed.appended):
        found.append(
            Violation("torn-cell", f"n is {observed.n} but L has {len(observed.appended)} items")
        )
    if list(observed.appended) != sorted(set(observed.appended)):
        found.append(Violation("order", f"L is not in the order sent: {observed.appended}"))
    return found


def check_runs(
    history: Sequence[CellRecord], ran: Mapping[int, Sequence[float]]
) -> list[Violation]:
    """No cell ran twice, and no cell reported lost ran (finished) after the report."""
    found = [
        Violation("ran-twice", f"cell {seq} ran {len(times)} times")
        for seq, times in sorted(ran.items())
        if len(times) > 1
    ]
    for r in history:
        late = [t for t in ran.get(r.seq, ()) if t > r.replied_at]
        if r.outcome == "lost" and late:
            found.append(
                Violation(
                    "ran-after-lost",
                    f"cell {r.seq} ran {late[0] - r.replied_at:.3f} s after the client got "
                    f"{r.ename}",
                )
            )
    return found


def check_execution_counts(counts: Sequence[int]) -> list[Violation]:
    """The ``execution_count`` of successive ok replies increases strictly."""
    return [
        Violation("execution-count", f"execution_count went from {a} to {b}")
        for a, b in itertools.pairwise(counts)
        if b <= a
    ]


def check_digests(digests: Mapping[int, str], alive: Sequence[int], after: int) -> list[Violation]:
    """Every live replica reached cell ``after`` and they all hold the same namespace."""
    found = [
        Violation("unsettled", f"replica {node} did not apply cell {after}")
        for node in alive
        if node not in digests
    ]
    if len(set(digests.values())) > 1:
        groups = ", ".join(f"{node}={d[:12]}" for node, d in sorted(digests.items()))
        found.append(Violation("diverged", f"namespace digests after cell {after}: {groups}"))
    return found


def check_appends(kernel: str, acknowledged: Sequence[int], held: Sequence[int]) -> list[Violation]:
    """Kernel ``kernel`` holds every append it acknowledged exactly once (``held``: its
    list as read back; an unacknowledged append may be there at most once)."""
    counts = Counter(held)
    missing = [a for a in acknowledged if counts[a] != 1]
    twice = sorted(a for a, n in counts.items() if n > 1 and a not in acknowledged)
    found = []
    if missing:
        times = ", ".join(f"{a} {counts[a]}x" for a in missing)
        detail = f"kernel {kernel} holds acknowledged appends {times}, not once each"
        found.append(Violation("kernel-state", detail))
    if twice:
        found.append(Violation("kernel-state", f"kernel {kernel} holds appends {twice} twice"))
    return found
