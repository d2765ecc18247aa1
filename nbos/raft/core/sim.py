"""A deterministic in-memory Raft group, for tests and fault-scenario scripts.

:class:`SimCluster` runs several :class:`RaftNode` s over a message list it
controls (deliver in order, deliver one, drop, duplicate, partition), keeps per
node a "durable" store holding exactly what went through ``Ready`` (so a crash
loses everything else), and a state machine that records applied entries.
While it runs it checks the Raft safety properties and raises
:class:`SafetyViolation` at the first breach:

* election safety: at most one leader per term;
* state machine safety: no two nodes apply different entries at one index;
* log matching and leader completeness, on demand via :meth:`check_logs`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from nbos.core.wire.raft import (
    ConfState,
    Entry,
    HardState,
    RaftPeerMessages,
    RaftVote,
    RaftVoteResponse,
    SnapshotMeta,
)
from nbos.raft.core.confchange import bootstrap
from nbos.raft.core.config import RaftConfig, StorageView
from nbos.raft.core.node import RaftNode, Role
from nbos.raft.core.ready import ReadState, Ready

_image_encoder = msgspec.msgpack.Encoder()
_image_decoder = msgspec.msgpack.Decoder(list[Entry])


class SafetyViolation(AssertionError):
    """A Raft safety property was broken."""


@dataclass
class Durable:
    """What one node persisted: the snapshot, the log after it, the hard state."""

    hard_state: HardState = field(default_factory=HardState)
    snapshot: SnapshotMeta = field(
        default_factory=lambda: SnapshotMeta(index=0, term=0, conf=ConfState(voters=[]))
    )
    snapshot_data: bytes = b""
    entries: list[Entry] = field(default_factory=list)

    @classmethod
    def of(cls, view: StorageView) -> Durable:
        return cls(view.hard_state, view.snapshot, view.snapshot_data, list(view.entries))

    def persist(self, rd: Ready) -> None:
        if rd.snapshot is not None:
            self.snapshot, self.snapshot_data = rd.snapshot.meta, rd.snapshot.data
            self.entries = []
        if rd.entries:
            first = rd.entries[0].index
            self.entries = [e for e in self.entries if e.index < first] + list(rd.entries)
        if rd.hard_state is not None:
            self.hard_state = rd.hard_state

    def view(self) -> StorageView:
        return StorageView(
            hard_state=self.hard_state,
            entries=tuple(self.entries),
            snapshot=self.snapshot,
            snapshot_data=self.snapshot_data,
        )


@dataclass
class SimMember:
    """One node of the simulation: its live Raft node (``None`` while crashed) and its stores."""

    durable: Durable
    node: RaftNode | None
    #: the state machine: every entry applied, by index (rebuilt on restart)
    applied: dict[int, Entry] = field(default_factory=dict)
    read_states: list[ReadState] = field(default_factory=list)


class SimCluster:
    """Raft nodes over a controllable in-memory network, with safety checks."""

    def __init__(self, views: dict[int, StorageView], config: RaftConfig, seed: int = 0) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.network: list[RaftPeerMessages] = []
        self.members: dict[int, SimMember] = {}
        self.blocked: set[frozenset[int]] = set()
        #: when a list, every message delivered is also appended to it
        self.trace: list[RaftPeerMessages] | None = None
        #: run Ready/advance right after every input; when False the caller runs
        #: :meth:`process` itself, and a crash loses the inputs not yet processed
        self.auto_process = True
        self.leaders: dict[int, int] = {}
        #: index -> the entry committed there, as first applied anywhere
        self.committed: dict[int, Entry] = {}
        #: index -> the term of the leader first seen committing it
        self.commit_term: dict[int, int] = {}
        for nid, view in views.items():
            self._start(nid, Durable.of(view))

    @classmethod
    def bootstrapped(cls, voters: list[int], config: RaftConfig, seed: int = 0) -> SimCluster:
        """A new group whose founding voters are ``voters``."""
        return cls({nid: bootstrap(voters) for nid in voters}, config, seed)

    # --- membership of the simulation ---------------------------------------------

    def add_node(self, nid: int) -> None:
        """Start a brand-new, empty node (to be added as a learner)."""
        self._start(nid, Durable())

    def crash(self, nid: int) -> None:
        """Lose everything not persisted through a Ready."""
        member = self.members[nid]
        member.node = None
        member.applied = {}
        member.read_states = []

    def restart(self, nid: int) -> None:
        self._start(nid, self.members[nid].durable)

    def _start(self, nid: int, durable: Durable) -> None:
        node = RaftNode(nid, durable.view(), self.config, random.Random(self.rng.random()))
        member = SimMember(durable, node)
        self.members[nid] = member
        self._restore(member, durable.snapshot_data)
        self.process(nid)

    def node(self, nid: int) -> RaftNode:
        node = self.members[nid].node
        assert node is not None, f"node {nid} is down"
        return node

    def alive(self) -> list[int]:
        return [nid for nid, m in self.members.items() if m.node is not None]

    # --- the network ----------------------------------------------------------------

    def partition(self, *groups: set[int]) -> None:
        """Cut every link between nodes of different groups."""
        self.blocked = {
            frozenset((a, b))
            for i, ga in enumerate(groups)
            for gb in groups[i + 1 :]
            for a in ga
            for b in gb
        }

    def heal(self) -> None:
        self.blocked = set()

    def deliver(self, position: int = 0) -> None:
        """Deliver (or lose, if its link is cut or its receiver down) one message."""
        msg = self.network.pop(position)
        member = self.members.get(msg.dst)
        if member is None or member.node is None or frozenset((msg.src, msg.dst)) in self.blocked:
            return
        if self.trace is not None:
            self.trace.append(msg)
        member.node.step(msg)
        if self.auto_process:
            self.process(msg.dst)

    def deliver_where(
        self, wanted: Callable[[RaftPeerMessages], bool], limit: int = 10_000
    ) -> None:
        """Deliver matching messages (others stay queued) until none is left."""
        for _ in range(limit):
            position = next((i for i, m in enumerate(self.network) if wanted(m)), None)
            if position is None:
                return
            self.deliver(position)
        raise AssertionError("network did not quiesce")

    def deliver_all(self, limit: int = 10_000) -> None:
        """Deliver in order until the network is quiet."""
        for _ in range(limit):
            if not self.network:
                return
            self.deliver(0)
        raise AssertionError("network did not quiesce")

    def tick(self, nids: list[int] | None = None) -> None:
        for nid in self.alive() if nids is None else nids:
            self.node(nid).tick()
            if self.auto_process:
                self.process(nid)

    def run(self, ticks: int) -> None:
        """``ticks`` rounds of: every live node ticks, then the network drains."""
        for _ in range(ticks):
            self.tick()
            self.deliver_all()

    def elect(self, nid: int, max_ticks: int = 200) -> None:
        """Make ``nid`` leader by ticking it alone until it campaigns and wins."""
        for _ in range(max_ticks):
            if self.node(nid).role is Role.LEADER:
                self.deliver_all()
                return
            self.tick([nid])
            self.deliver_all()
        raise AssertionError(f"node {nid} did not become leader")

    def elect_on_votes(self, nid: int, max_ticks: int = 200) -> None:
        """Make ``nid`` leader delivering vote messages only (the rest stay queued).

        So the new leader has not committed its no-op yet: what it may do only
        after its first commit can be tested right after this returns.
        """
        for _ in range(max_ticks):
            if self.node(nid).role is Role.LEADER:
                return
            self.tick([nid])
            self.deliver_where(lambda m: isinstance(m, RaftVote | RaftVoteResponse))
        raise AssertionError(f"node {nid} did not become leader")

    def leader(self) -> int | None:
        """The live leader of the highest term that takes proposals, if any."""
        live = [
            (self.node(n).term, n)
            for n in self.alive()
            if self.node(n).role is Role.LEADER and not self.node(n).leaving
        ]
        return max(live)[1] if live else None

    def wait_leader(self, max_ticks: int = 300) -> int:
        for _ in range(max_ticks):
            lead = self.leader()
            if lead is not None and self.node(lead).log.term(self.node(lead).commit_index) == (
                self.node(lead).term
            ):
                return lead
            self.run(1)
        raise AssertionError("no leader emerged")

    # --- the driver loop ----------------------------------------------------------------

    def process(self, nid: int, limit: int | None = None) -> None:
        """Run Ready/advance for ``nid`` until it has nothing left to do (or ``limit`` times)."""
        member = self.members[nid]
        node = member.node
        assert node is not None
        done = 0
        while (limit is None or done < limit) and (rd := node.ready()) is not None:
            done += 1
            member.durable.persist(rd)
            self.network.extend(rd.messages)
            if rd.snapshot is not None:
                self._restore(member, rd.snapshot.data)
            for entry in rd.committed_entries:
                self._apply(member, entry)
            member.read_states.extend(rd.read_states)
            node.advance(rd)
            self._observe(node)
        self._observe(node)

    def compact(self, nid: int) -> None:
        """Snapshot ``nid``'s state machine at its applied index and compact its log."""
        member = self.members[nid]
        node = self.node(nid)
        index = node.applied_index
        image = _image_encoder.encode([member.applied[i] for i in sorted(member.applied)])
        node.compact(index, image)
        snap = node.snapshot
        member.durable.snapshot, member.durable.snapshot_data = snap.meta, snap.data
        member.durable.entries = [e for e in member.durable.entries if e.index > index]

    def _apply(self, member: SimMember, entry: Entry) -> None:
        known = self.committed.setdefault(entry.index, entry)
        if known != entry:
            raise SafetyViolation(f"index {entry.index} applied as {entry} and as {known}")
        member.applied[entry.index] = entry

    def _restore(self, member: SimMember, image: bytes) -> None:
        member.applied = {}
        for entry in _image_decoder.decode(image) if image else []:
            self._apply(member, entry)

    def _observe(self, node: RaftNode) -> None:
        if node.role is not Role.LEADER:
            return
        other = self.leaders.setdefault(node.term, node.id)
        if other != node.id:
            raise SafetyViolation(f"two leaders in term {node.term}: {other} and {node.id}")
        for index in range(node.commit_index, 0, -1):
            if index in self.commit_term:
                break
            self.commit_term[index] = node.term

    # --- whole-cluster checks -------------------------------------------------------------

    def check_logs(self) -> None:
        """Log matching among live nodes, and leader completeness of every live leader."""
        nodes = [self.node(n) for n in self.alive()]
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                _check_matching(a, b)
        for node in nodes:
            if node.role is Role.LEADER:
                self._check_complete(node)

    def _check_complete(self, leader: RaftNode) -> None:
        for index, term in self.commit_term.items():
            entry = self.committed.get(index)
            if term > leader.term or index <= leader.log.offset or entry is None:
                continue
            if leader.log.term(index) != entry.term:
                raise SafetyViolation(
                    f"leader {leader.id} (term {leader.term}) lacks committed entry {entry}"
                )


def _check_matching(a: RaftNode, b: RaftNode) -> None:
    lo = max(a.log.offset, b.log.offset) + 1
    hi = min(a.log.last_index(), b.log.last_index())
    for index in range(hi, lo - 1, -1):
        if a.log.term(index) == b.log.term(index):
            # same index and term: the logs must be identical up to here
            same = a.log.slice(lo, index + 1) == b.log.slice(lo, index + 1)
            if not same:
                raise SafetyViolation(f"logs of {a.id} and {b.id} differ below index {index}")
            return
