"""The kernel's Raft state machine: claims, cell state and ``Done`` bookkeeping.

``apply`` runs on the Raft thread, synchronously and deterministically: it decides
which entries count (see :mod:`nbos.core.wire.entries`) and hands the ones that
change the namespace to ``on_event`` as :class:`CellCommitted`, :class:`CommDelivered`
or :class:`Restored`. Those are applied to the user namespace later, in the same
order, by the replica's applier on the kernel's own thread (namespace changes may
need blob fetches, which are async).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs
import msgspec

from nbos.core.errors import DecodeError
from nbos.core.wire import decode
from nbos.core.wire.entries import CellStatus, Claim, CommEntry, Done
from nbos.core.wire.state import StateDelta

log = logging.getLogger(__name__)

#: How many finished cells' outcomes are remembered for late proposers.
_RECENT = 64


class Outcome(msgspec.Struct, array_like=True, frozen=True):
    """What ``apply`` hands back to an entry's proposer.

    ``winner`` is the claim winner of the cell (``-1`` when none), for a ``Done`` that
    of the next cell (the ``Done`` may carry its claim); ``status`` and
    ``execution_count`` describe the cell's committed ``Done`` (``""`` while none).
    """

    index: int
    accepted: bool
    winner: int = -1
    status: str = ""
    execution_count: int = 0


@attrs.frozen
class Restored:
    """The state was replaced by a snapshot: load ``namespace``, then apply ``deltas``."""

    namespace: bytes
    deltas: tuple[StateDelta, ...]
    last_done: int
    execution_count: int


@attrs.frozen
class CellCommitted:
    """Cell ``exec_index``'s ``Done`` committed; ``state`` is what it changed, if it counts.

    ``counts``: the ``Done`` came from the claim winner with status ``ok`` or
    ``error``. When it does not, ``committed`` is the kernel's committed state as of
    this entry, for the replica that ran the cell anyway: its namespace holds changes
    no other replica has, and it rolls back to this.
    """

    exec_index: int
    replica: int
    status: CellStatus
    execution_count: int
    state: StateDelta | None = None
    code: str = ""
    counts: bool = True
    committed: Restored | None = None


@attrs.frozen
class CommDelivered:
    """A client comm message committed at log ``index``; every replica dispatches it."""

    index: int
    replica: int
    message: bytes
    buffers: tuple[bytes, ...]


Event = CellCommitted | CommDelivered | Restored


class _Image(msgspec.Struct, frozen=True):
    last_done: int
    execution_count: int
    claims: dict[int, int]
    recent: dict[int, tuple[str, int]]
    namespace: bytes
    namespace_cell: int
    replay: list[StateDelta]


_outcome_codec = msgspec.msgpack.Encoder()
_outcome_decoder = msgspec.msgpack.Decoder(Outcome)
_image_decoder = msgspec.msgpack.Decoder(_Image)


def decode_outcome(data: bytes) -> Outcome:
    """Decode an ``apply`` result; raises :class:`DecodeError` for anything else."""
    try:
        return _outcome_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise DecodeError(f"bad kernel log outcome: {exc}") from exc


class KernelStateMachine:
    """Deterministic bookkeeping of one kernel's log (implements ``StateMachine``).

    The snapshot image holds the counters, a namespace image as of some cell's
    ``Done`` and the deltas committed after it, so a replica restored from it
    rebuilds the same namespace. The kernel hands in fresher namespace images with
    :meth:`rebase` (from its own thread), which keeps the replayed tail short.
    """

    def __init__(self, on_event: Callable[[Event], None]) -> None:
        self._on_event = on_event
        # apply/snapshot/restore run on the Raft thread, rebase on the kernel's thread.
        self._lock = threading.Lock()
        self.last_done = 0
        self.execution_count = 1
        self._claims: dict[int, int] = {}
        self._recent: dict[int, tuple[str, int]] = {}
        self._namespace = b""
        self._namespace_cell = 0
        self._replay: list[StateDelta] = []
        self._replay_bytes = 0

    @property
    def replay_bytes(self) -> int:
        """Inline bytes of the deltas a snapshot would replay on top of its namespace image."""
        with self._lock:
            return self._replay_bytes

    def rebase(self, cell: int, namespace: bytes) -> None:
        """``namespace`` is the image of the namespace once cell ``cell``'s ``Done`` applied."""
        with self._lock:
            if cell < self._namespace_cell or cell > self.last_done:
                return
            self._namespace, self._namespace_cell = namespace, cell
            self._replay = [d for d in self._replay if d.exec_index > cell]
            self._replay_bytes = sum(len(d.set) for d in self._replay)

    def apply(self, index: int, data: bytes) -> bytes:
        with self._lock:
            return self._apply(index, data)

    def _apply(self, index: int, data: bytes) -> bytes:
        try:
            entry = decode(data)
        except DecodeError as exc:
            log.warning("kernel log entry %d ignored: %s", index, exc)
            return self._outcome(index, accepted=False)
        if isinstance(entry, Claim):
            return self._claim(index, entry)
        if isinstance(entry, Done):
            return self._done(index, entry)
        if isinstance(entry, CommEntry):
            self._on_event(CommDelivered(index, entry.replica, entry.message, tuple(entry.buffers)))
            return self._outcome(index, accepted=True)
        log.warning("kernel log entry %d ignored: %s is not a kernel entry", index, type(entry))
        return self._outcome(index, accepted=False)

    def _claim(self, index: int, claim: Claim) -> bytes:
        cell = claim.exec_index
        accepted = cell > self.last_done and cell not in self._claims
        if accepted:
            self._claims[cell] = claim.replica
        return self._outcome(index, accepted=accepted, cell=cell)

    def _done(self, index: int, done: Done) -> bytes:
        cell = done.exec_index
        if cell <= self.last_done:
            return self._outcome(index, accepted=False, cell=cell)
        counts = done.status in ("ok", "error") and self._claims.get(cell) == done.replica
        state = done.state if counts else None
        if done.status != "lost":
            self.execution_count = done.execution_count
        self.last_done = cell
        if state is not None:
            self._replay.append(state)
            self._replay_bytes += len(state.set)
        self._recent[cell] = (done.status, self.execution_count)
        for old in [c for c in self._recent if c <= cell - _RECENT]:
            del self._recent[old]
        for old in [c for c in self._claims if c <= cell]:
            del self._claims[old]
        if counts and done.claim_next and cell + 1 not in self._claims:
            self._claims[cell + 1] = done.replica
        code = done.code if counts else ""
        committed = None if counts else self._committed()
        count = self.execution_count
        self._on_event(
            CellCommitted(cell, done.replica, done.status, count, state, code, counts, committed)
        )
        return self._outcome(index, accepted=True, cell=cell, claimed=cell + 1)

    def claim_stands(self, cell: int, replica: int) -> bool:
        """Whether ``replica``'s claim of ``cell`` won and no ``Done`` for it committed yet."""
        with self._lock:
            return cell > self.last_done and self._claims.get(cell) == replica

    def progress(self) -> tuple[int, int]:
        """The last committed ``Done``'s cell, and the replica holding the next cell's claim
        (``-1``: none)."""
        with self._lock:
            return self.last_done, self._claims.get(self.last_done + 1, -1)

    def _committed(self) -> Restored:
        # The image and the deltas after it are the namespace as of the last counted Done.
        return Restored(self._namespace, tuple(self._replay), self.last_done, self.execution_count)

    def _outcome(
        self, index: int, *, accepted: bool, cell: int | None = None, claimed: int | None = None
    ) -> bytes:
        claimed = cell if claimed is None else claimed
        winner = self._claims.get(claimed, -1) if claimed is not None else -1
        status, count = self._recent.get(cell, ("", self.execution_count)) if cell else ("", 0)
        return _outcome_codec.encode(Outcome(index, accepted, winner, status, count))

    def snapshot(self) -> bytes:
        with self._lock:
            image = _Image(
                self.last_done,
                self.execution_count,
                self._claims,
                self._recent,
                self._namespace,
                self._namespace_cell,
                self._replay,
            )
            return _outcome_codec.encode(image)

    def restore(self, image: bytes) -> None:
        with self._lock:
            self._restore(image)

    def _restore(self, image: bytes) -> None:
        try:
            state = _image_decoder.decode(image)
        except msgspec.MsgspecError as exc:
            # A snapshot the log verified but we cannot read is a version skew; keep going
            # with the state we have rather than crash the replica.
            log.warning("kernel snapshot ignored: %s", exc)
            return
        self.last_done = state.last_done
        self.execution_count = state.execution_count
        self._claims = dict(state.claims)
        self._recent = {k: (s, c) for k, (s, c) in state.recent.items()}
        self._namespace, self._namespace_cell = state.namespace, state.namespace_cell
        self._replay = list(state.replay)
        self._replay_bytes = sum(len(d.set) for d in self._replay)
        self._on_event(self._committed())
