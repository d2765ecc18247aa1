"""Configuration of a Raft node and the durable state it starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbos.core.errors import ConfigError
from nbos.core.wire.raft import ConfState, Entry, HardState, SnapshotMeta


@dataclass(frozen=True)
class RaftConfig:
    """Tunables of a :class:`~nbos.raft.core.RaftNode`; times are in ticks.

    * ``election_ticks``: a follower campaigns after a random timeout in
      ``[election_ticks, 2 * election_ticks)`` without hearing from a leader; a
      leader with ``check_quorum`` steps down when it has not heard from a quorum
      for ``election_ticks``.
    * ``heartbeat_ticks``: the leader's heartbeat interval (must be below
      ``election_ticks``). While ``2 * heartbeat_ticks`` is below ``election_ticks``, a
      round skips the followers that an append reached since the last round.
    * ``max_inflight``: appends in flight per follower in replicate state.
    * ``max_batch_bytes``: payload bytes per append (at least one entry is sent).
    * ``snapshot_chunk_bytes``: bytes of snapshot image per InstallSnapshot chunk.
    * ``quiesce_ticks``: a leader whose group had nothing in flight, every member
      holding the whole log, for this many ticks quiesces it: no more heartbeats, and
      followers stop their election timers, until anything wakes it (0: never).
    """

    election_ticks: int = 10
    heartbeat_ticks: int = 1
    max_inflight: int = 64
    max_batch_bytes: int = 1 << 20
    snapshot_chunk_bytes: int = 1 << 20
    check_quorum: bool = True
    pre_vote: bool = True
    quiesce_ticks: int = 0

    def __post_init__(self) -> None:
        positive = ("heartbeat_ticks", "max_inflight", "max_batch_bytes", "snapshot_chunk_bytes")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(key, getattr(self, key), "an int >= 1")
        if self.quiesce_ticks < 0:
            raise ConfigError("quiesce_ticks", self.quiesce_ticks, "an int >= 0")
        if self.election_ticks <= self.heartbeat_ticks:
            raise ConfigError("election_ticks", self.election_ticks, "more than heartbeat_ticks")


@dataclass(frozen=True)
class StorageView:
    """What a node restarts from: everything a previous life persisted through ``Ready``.

    ``entries`` follow ``snapshot.index`` contiguously; ``snapshot_data`` is the
    image for ``snapshot`` (empty when ``snapshot.index == 0``). A brand-new
    member that joins an existing group starts from ``StorageView()``: empty
    log, empty membership; it learns both from the leader.
    """

    hard_state: HardState = field(default_factory=HardState)
    entries: tuple[Entry, ...] = ()
    snapshot: SnapshotMeta = field(
        default_factory=lambda: SnapshotMeta(index=0, term=0, conf=ConfState(voters=[]))
    )
    snapshot_data: bytes = b""
