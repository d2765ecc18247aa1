"""The output of a :class:`~nbos.raft.core.RaftNode`: what the driver must do next."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbos.core.wire.raft import Entry, HardState, RaftPeerMessages, SnapshotMeta


@dataclass(frozen=True)
class Snapshot:
    """A snapshot image and the log position and membership it stands for."""

    meta: SnapshotMeta
    data: bytes


@dataclass(frozen=True)
class ReadState:
    """A ReadIndex answer: reads for ``ctx`` are linearizable once ``index`` is applied."""

    index: int
    ctx: bytes


@dataclass(frozen=True)
class Ready:
    """One batch of work for the driver, to be done **in this order**:

    1. Persist, durably (fsync per policy):
       ``snapshot`` if set (storage drops its whole log and records the
       snapshot), then ``entries`` (storage first drops every stored entry with
       index ``>= entries[0].index``, then appends), then ``hard_state`` if set.
    2. Send ``messages``. They may depend on the state persisted in step 1 (a
       vote grant on the vote, an append acknowledgement on the entries), so
       they must not leave before it is durable.
    3. Restore the state machine from ``snapshot`` if set, then apply
       ``committed_entries`` in order (``kind="normal"`` ones; ``"noop"`` and
       ``"conf"`` entries advance the index only). Hand ``read_states`` to the
       waiting readers once their index is applied.
    4. Call :meth:`RaftNode.advance` with this object.
    """

    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    messages: list[RaftPeerMessages] = field(default_factory=list)
    committed_entries: list[Entry] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
