"""A linearizability checker for key-value histories (Wing & Gong search, Lowe's memoization).

A history is a list of :class:`Operation`: each has an invocation and a
completion time as the client saw them, and what it returned. It is
linearizable when every operation can be given a single instant between its
invocation and completion such that running the operations in that order on a
sequential key-value store gives exactly the recorded results.

The search (as in Porcupine, Anish Athalye's checker):

* Keys are independent registers, so the history is split by key and each part
  checked alone (P-compositionality); this is what keeps the search small.
* The calls and returns of a part sit in one list ordered by time. Walking it
  from the front, the first entries that are *calls* are the operations that
  may take effect next (nothing that returned before them is still waiting). We
  try to linearize one: if the model accepts it, both its call and its return
  are cut out of the list and the walk restarts at the front; if we reach a
  *return* first, the operation it belongs to could not be placed before it, so
  we undo the last choice (backtrack) and try the next candidate.
* A (set of linearized operations, model state) pair that was already explored
  is never explored again: it led nowhere the first time.

Operations whose outcome is unknown (a write that timed out) have completion
time ``math.inf`` and ``known=False``: they may take effect at any point after
their invocation, or, since their return lies after everything, effectively
never as far as the others can tell. Failed reads are simply left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

#: The state of one key: its value, or None while it was never written.
State = str | None


@dataclass(frozen=True)
class Operation:
    """One client operation on ``key``.

    ``kind`` is ``put`` (set to ``value``), ``append`` (append ``value``) or
    ``get``. ``output`` is what it returned: a ``get``'s value (None for a missing
    key); for ``put``/``append`` the length of the value after it, or None when
    not recorded. ``known=False`` marks a write whose outcome is unknown.
    """

    client: str
    call: float
    ret: float
    kind: str
    key: str
    value: str = ""
    output: str | int | None = None
    known: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("put", "append", "get"):
            raise ValueError(f"unknown operation kind {self.kind!r}")
        if self.ret < self.call:
            raise ValueError(f"operation returns ({self.ret}) before it is called ({self.call})")
        if not self.known and self.kind == "get":
            raise ValueError("a read of unknown outcome carries no information: leave it out")


def step(state: State, op: Operation) -> tuple[bool, State]:
    """The sequential model: is ``op``'s output right in ``state``, and the state after it."""
    if op.kind == "get":
        return (not op.known or op.output == state), state
    after = op.value if op.kind == "put" else (state or "") + op.value
    ok = not op.known or op.output is None or op.output == len(after)
    return ok, after


@dataclass(eq=False)
class _Entry:
    """A call or return in the doubly linked event list."""

    op: int
    is_call: bool
    match: _Entry | None = None  # a call's return entry
    prev: _Entry | None = field(default=None, repr=False)
    next: _Entry | None = field(default=None, repr=False)


def _event_list(ops: list[Operation]) -> _Entry:
    """The head sentinel of the calls and returns of ``ops`` in time order.

    At equal times calls come before returns, i.e. touching operations count as
    concurrent: the checker never rejects a history for a tie in the clock.
    """
    events = sorted(
        [(op.call, 0, i) for i, op in enumerate(ops)] + [(op.ret, 1, i) for i, op in enumerate(ops)]
    )
    head = _Entry(op=-1, is_call=False)
    calls: dict[int, _Entry] = {}
    last = head
    for _, kind, i in events:
        entry = _Entry(op=i, is_call=kind == 0)
        if entry.is_call:
            calls[i] = entry
        else:
            calls[i].match = entry
        entry.prev, last.next = last, entry
        last = entry
    return head


def _lift(entry: _Entry) -> None:
    """Cut a call and its return out of the list (they stay linked for ``_unlift``)."""
    for e in (entry, entry.match):
        assert e is not None and e.prev is not None
        e.prev.next = e.next
        if e.next is not None:
            e.next.prev = e.prev


def _unlift(entry: _Entry) -> None:
    for e in (entry.match, entry):
        assert e is not None and e.prev is not None
        e.prev.next = e
        if e.next is not None:
            e.next.prev = e


def check_register(ops: list[Operation], initial: State = None) -> bool:
    """Whether the operations on one key are linearizable from ``initial``."""
    head = _event_list(ops)
    explored: set[tuple[int, State]] = set()
    undo: list[tuple[_Entry, State]] = []
    linearized = 0
    state = initial
    entry = head.next
    while head.next is not None:
        assert entry is not None  # the list ends with a return, which stops the walk
        if entry.is_call:
            ok, after = step(state, ops[entry.op])
            bits = linearized | (1 << entry.op)
            if ok and (bits, after) not in explored:
                explored.add((bits, after))
                undo.append((entry, state))
                linearized, state = bits, after
                _lift(entry)
                entry = head.next
                continue
            entry = entry.next
            continue
        # a return: its operation found no place before it under the choices so far
        if not undo:
            return False
        entry, state = undo.pop()
        linearized &= ~(1 << entry.op)
        _unlift(entry)
        entry = entry.next
    return True


def check(history: Iterable[Operation]) -> list[str]:
    """The keys whose operations are not linearizable (empty: the history is linearizable)."""
    by_key: dict[str, list[Operation]] = defaultdict(list)
    for op in history:
        by_key[op.key].append(op)
    return sorted(key for key, ops in by_key.items() if not check_register(ops))
