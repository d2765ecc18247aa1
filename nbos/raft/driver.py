"""The anyio driver: runs a sans-IO :class:`~nbos.raft.core.RaftNode` over a Transport and storage.

One task owns the node (as etcd-io/raft's node loop does): ticks, peer messages
and client calls reach it through one queue, and it runs each ``Ready`` to the
end (persist in a worker thread, send, apply, advance) before it takes more
input, which is what the core's contract asks. Other tasks only read the
transport, tick, and wait on outcomes that the node loop sets.

The driver wraps application data in a :class:`~nbos.core.wire.log_commands.Proposal`
carrying a client session ``(client_id, seq)``: a retried proposal with the same
pair applies once, and the retry gets the first result. Sessions, member
addresses and the application image together form the Raft snapshot.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import random
import time
import typing
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.abc import TaskGroup

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    DecodeError,
    LogClosedError,
    NotLeaderError,
    ProposalTimeoutError,
    TransportClosedError,
    UnknownPeerError,
)
from nbos.core.ids import NodeId, PeerId
from nbos.core.replicated_log import StateMachine
from nbos.core.transport import Transport
from nbos.core.wire import decode, encode
from nbos.core.wire.log_commands import ClientSession, DriverSnapshot, MemberAddress, Proposal
from nbos.core.wire.raft import ConfChange, Entry, RaftAppend, RaftPeerMessages, SnapshotMeta
from nbos.raft._waiters import Outcome, Watermark
from nbos.raft.core import RaftConfig, RaftNode, Ready, StorageView, bootstrap
from nbos.raft.storage import DiskStorage, LogStorage, MemoryStorage

log = logging.getLogger(__name__)

T = TypeVar("T")

_PEER_MESSAGES: tuple[type, ...] = typing.get_args(RaftPeerMessages)
_command_decoder = msgspec.msgpack.Decoder(Proposal | MemberAddress)
_snapshot_decoder = msgspec.msgpack.Decoder(DriverSnapshot)
_encoder = msgspec.msgpack.Encoder()
#: A Ready with at most this many bytes of entries (and no snapshot) is written on the
#: node loop itself: for a small write, the fsync costs less than the two thread
#: switches of handing it to a worker, and every consensus round has such a write.
_INLINE_PERSIST_BYTES = 64 * 1024


class _Pending:
    """A proposal waiting for its entry to be applied."""

    def __init__(self, client_id: str, seq: int, timeout: float = math.inf) -> None:
        self.client_id = client_id
        self.seq = seq
        self.timeout = timeout
        self.outcome: Outcome[bytes] = Outcome()

    def expire(self) -> None:
        self.outcome.fail(
            ProposalTimeoutError(
                f"proposal {self.client_id}/{self.seq} not applied within {self.timeout}s"
            )
        )


class RaftReplicatedLog:
    """:class:`~nbos.core.replicated_log.ReplicatedLog` over the in-tree Raft.

    Made by :func:`open_raft_log`, which runs its tasks.
    """

    def __init__(
        self,
        *,
        node: RaftNode,
        storage: LogStorage,
        transport: Transport,
        state_machine: StateMachine,
        settings: RaftSettings,
        peers: Mapping[NodeId, PeerId],
    ) -> None:
        self._node = node
        self._storage = storage
        self._transport = transport
        self._sm = state_machine
        self._settings = settings
        self._peers: dict[int, PeerId] = {int(n): p for n, p in peers.items()}
        self._addresses: dict[int, MemberAddress] = {}
        self._sessions: dict[str, ClientSession] = {}
        self._pending: dict[int, _Pending] = {}
        # (deadline, tiebreak, proposal): the tick loop fails the overdue ones
        self._deadlines: list[tuple[float, int, _Pending]] = []
        self._tiebreak = itertools.count()
        self._reads: dict[bytes, Outcome[int]] = {}
        self._applied = Watermark(node.applied_index)
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Callable[[], None]](
            10_000
        )
        self._client_id = f"node-{node.id}-{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self._closed = False
        self._last_snapshot = node.snapshot.meta.index
        #: Set by the node loop when the node is awake: the tick loop waits on it while
        #: the node is quiesced, so an idle group costs no wake-ups at all.
        self._awake = anyio.Event()

    # --- ReplicatedLog -------------------------------------------------------------

    @property
    def node_id(self) -> NodeId:
        return NodeId(self._node.id)

    @property
    def leader_id(self) -> NodeId | None:
        leader = self._node.leader_id
        return None if leader is None else NodeId(leader)

    @property
    def applied_index(self) -> int:
        return self._applied.value

    @property
    def commit_index(self) -> int:
        return self._node.commit_index

    @property
    def quiesced(self) -> bool:
        """Whether the node is quiesced (its group idle: no ticks, no heartbeats)."""
        return self._node.quiesced

    def voters(self) -> Sequence[NodeId]:
        return [NodeId(v) for v in self._node.conf.voters]

    def learners(self) -> Sequence[NodeId]:
        return [NodeId(v) for v in self._node.conf.learners]

    async def propose(
        self,
        data: bytes,
        *,
        client_id: str | None = None,
        seq: int | None = None,
        timeout: float = 10.0,
    ) -> bytes:
        if client_id is None or seq is None:
            self._seq += 1
            client_id, seq = self._client_id, self._seq
        session = self._sessions.get(client_id)
        if session is not None and session.seq == seq:
            return session.result
        payload = _encoder.encode(Proposal(client_id, seq, data))
        return await self._replicate(payload, _Pending(client_id, seq), timeout)

    async def read_index(self, *, timeout: float = 10.0) -> int:
        ctx = uuid.uuid4().bytes
        outcome: Outcome[int] = Outcome()

        def ask() -> None:
            self._reads[ctx] = outcome
            self._node.read_index(ctx)

        try:
            with anyio.fail_after(timeout):
                await self._call(ask)
                index = await outcome.wait()
                await self._applied.wait_for(index)
                return index
        except TimeoutError:
            raise ProposalTimeoutError(f"read index not confirmed within {timeout}s") from None
        finally:
            self._reads.pop(ctx, None)

    def wake(self) -> None:
        """Wake the node from quiescence (something will need the group); from its loop only."""
        # a full inbox means a busy node; a closed one needs nothing
        with contextlib.suppress(
            anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError
        ):
            self._inbox_send.send_nowait(self._node.wake)

    async def wait_applied(self, index: int) -> None:
        await self._applied.wait_for(index)

    async def add_learner(self, node: NodeId, peer: PeerId, address: str) -> None:
        # The address goes through the log first so every member, and any later
        # leader, can reach the learner.
        await self._replicate_command(MemberAddress(int(node), str(peer), address))
        await self._change(ConfChange("add_learner", int(node)))

    async def promote(self, node: NodeId) -> None:
        await self._change(ConfChange("promote", int(node)))

    async def remove(self, node: NodeId) -> None:
        await self._change(ConfChange("remove", int(node)))

    async def transfer_leadership(self, node: NodeId) -> None:
        await self._call(lambda: self._node.transfer_leadership(int(node)))

    async def aclose(self) -> None:
        self._fail_all(LogClosedError("the replicated log was closed"))
        self._closed = True
        await self._inbox_send.aclose()

    # --- calls into the node loop --------------------------------------------------

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the node loop, between two Ready cycles; re-raises what it raises."""
        if self._closed:
            raise LogClosedError("the replicated log was closed")
        outcome: Outcome[T] = Outcome()

        def run() -> None:
            try:
                outcome.set(fn())
            except Exception as exc:
                outcome.fail(exc)

        try:
            await self._inbox_send.send(run)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise LogClosedError("the replicated log was closed") from None
        return await outcome.wait()

    async def _replicate(self, payload: bytes, pending: _Pending, timeout: float) -> bytes:
        """Append on the node loop and wait for the entry to apply, in one trip.

        This is the hot path under load, so it avoids a cancel scope and timer per
        proposal: the deadline goes on a heap that the tick loop sweeps (so it is
        kept to within a tick), and a refusal by the node fails the same outcome
        that the apply sets.
        """

        def append() -> None:
            try:
                self._pending[self._node.propose(payload)] = pending
            except Exception as exc:
                pending.outcome.fail(exc)

        if self._closed:
            raise LogClosedError("the replicated log was closed")
        pending.timeout = timeout
        deadline = time.monotonic() + timeout
        heapq.heappush(self._deadlines, (deadline, next(self._tiebreak), pending))
        try:
            try:
                self._inbox_send.send_nowait(append)
            except anyio.WouldBlock:
                await self._inbox_send.send(append)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise LogClosedError("the replicated log was closed") from None
        return await pending.outcome.wait()

    def _expire(self) -> None:
        now = time.monotonic()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][2].outcome.done):
            heapq.heappop(heap)[2].expire()

    async def _replicate_command(self, command: MemberAddress) -> None:
        self._seq += 1
        pending = _Pending(self._client_id, self._seq)
        await self._replicate(_encoder.encode(command), pending, timeout=10.0)

    async def _change(self, change: ConfChange) -> None:
        pending = _Pending("", 0)

        def propose() -> None:
            self._pending[self._node.propose_conf_change(change)] = pending

        await self._call(propose)
        await pending.outcome.wait()

    # --- the loops -----------------------------------------------------------------

    async def _run(self, task_group: TaskGroup) -> None:
        task_group.start_soon(self._tick_loop)
        task_group.start_soon(self._receive_loop)
        await self._node_loop()

    async def _tick_loop(self) -> None:
        interval = self._settings.tick_ms / 1000
        while True:
            await anyio.sleep(interval)
            self._expire()
            if self._node.quiesced:
                # nothing to time until an input wakes the node (it has no proposal
                # in flight whose deadline could pass meanwhile)
                self._awake = anyio.Event()
                await self._awake.wait()
                continue
            try:
                self._inbox_send.send_nowait(self._node.tick)
            except anyio.WouldBlock:
                log.warning("node %d: inbox full, skipping a tick", self._node.id)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    async def _receive_loop(self) -> None:
        while True:
            try:
                sender, payload = await self._transport.receive()
            except TransportClosedError:
                return
            message = self._parse(sender, payload)
            if message is None:
                continue
            self._peers.setdefault(message.src, sender)
            try:
                await self._inbox_send.send(_stepper(self._node, message))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    def _parse(self, sender: PeerId, payload: bytes) -> Any:
        try:
            message = decode(payload)
        except DecodeError as exc:
            log.warning("node %d: dropped a bad message from %s: %s", self._node.id, sender, exc)
            return None
        if not isinstance(message, _PEER_MESSAGES):
            log.warning("node %d: %s is not a Raft message", self._node.id, type(message).__name__)
            return None
        return message

    async def _node_loop(self) -> None:
        async for first in self._inbox:
            first()
            while True:  # take everything already queued before the next Ready
                try:
                    self._inbox.receive_nowait()()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    # EndOfStream: closed while draining; the `async for` then ends.
                    break
            while (rd := self._node.ready()) is not None:
                await self._handle(rd)
            await self._maybe_snapshot()
            if not self._node.quiesced:
                self._awake.set()

    async def _handle(self, rd: Ready) -> None:
        # A leader's appends go out before its own write (Raft thesis 10.2.1), so the
        # followers' fsyncs overlap the leader's: safe because this loop steps no
        # answer to them, hence commits nothing, until the Ready below is persisted.
        # Every other message (votes, acks) must wait for the write it vouches for.
        for append in rd.messages:
            if isinstance(append, RaftAppend):
                await self._send(append)
        if rd.snapshot is None and sum(len(e.data) for e in rd.entries) <= _INLINE_PERSIST_BYTES:
            self._persist(rd)
        else:
            with anyio.CancelScope(shield=True):
                # A Ready is persisted whole or the process dies: never half of it.
                await anyio.to_thread.run_sync(self._persist, rd)
        for message in rd.messages:
            if not isinstance(message, RaftAppend):
                await self._send(message)
        if rd.snapshot is not None:
            self._restore(rd.snapshot.data)
        for entry in rd.committed_entries:
            self._apply(entry)
        self._node.advance(rd)
        for state in rd.read_states:
            outcome = self._reads.get(state.ctx)
            if outcome is not None:
                outcome.set(state.index)
        if rd.committed_entries:
            self._applied.advance(rd.committed_entries[-1].index)
        elif rd.snapshot is not None:
            self._applied.advance(rd.snapshot.meta.index)

    def _persist(self, rd: Ready) -> None:
        if rd.snapshot is not None:
            self._storage.save_snapshot(rd.snapshot.meta, rd.snapshot.data)
        if rd.entries or rd.hard_state is not None:
            self._storage.save(rd.hard_state, rd.entries)

    async def _send(self, message: RaftPeerMessages) -> None:
        peer = self._peers.get(message.dst)
        if peer is None:
            log.debug("node %d: no address for node %d yet", self._node.id, message.dst)
            return
        try:
            await self._transport.send(peer, encode(message))
        except UnknownPeerError:
            log.debug("node %d: transport does not know %s", self._node.id, peer)
        except TransportClosedError:
            log.debug("node %d: transport closed while sending", self._node.id)

    # --- applying --------------------------------------------------------------------

    def _apply(self, entry: Entry) -> None:
        pending = self._pending.pop(entry.index, None)
        if entry.kind == "conf":
            if pending is not None:
                pending.outcome.set(b"")
            return
        if entry.kind != "normal":
            if pending is not None:  # our proposal was overwritten by a new leader's no-op
                pending.outcome.fail(NotLeaderError(self._node.leader_id))
            return
        try:
            command = _command_decoder.decode(entry.data)
        except (msgspec.MsgspecError, ValueError):
            log.exception("node %d: undecodable entry %d skipped", self._node.id, entry.index)
            return
        result = self._apply_command(entry.index, command)
        if pending is None:
            return
        if isinstance(command, Proposal) and (command.client_id, command.seq) == (
            pending.client_id,
            pending.seq,
        ):
            pending.outcome.set(result)
        elif isinstance(command, MemberAddress) and pending.client_id == self._client_id:
            pending.outcome.set(b"")
        else:
            pending.outcome.fail(NotLeaderError(self._node.leader_id))

    def _apply_command(self, index: int, command: Proposal | MemberAddress) -> bytes:
        if isinstance(command, MemberAddress):
            self._learn_address(command)
            return b""
        session = self._sessions.get(command.client_id)
        if session is not None and command.seq <= session.seq:
            # A retry of something already applied: the first result stands.
            return session.result if command.seq == session.seq else b""
        try:
            result = self._sm.apply(index, command.data)
        except Exception:
            # The StateMachine contract forbids raising; every replica hits the same
            # entry, so skipping it keeps them equal rather than stopping all of them.
            log.exception("node %d: state machine raised on entry %d", self._node.id, index)
            result = b""
        self._sessions[command.client_id] = ClientSession(command.client_id, command.seq, result)
        return result

    def _learn_address(self, member: MemberAddress) -> None:
        self._addresses[member.node] = member
        if member.node == self._node.id:
            return
        self._peers[member.node] = PeerId(member.peer)
        self._transport.add_peer(PeerId(member.peer), member.address)

    # --- snapshots -------------------------------------------------------------------

    def _image(self) -> bytes:
        return _encoder.encode(
            DriverSnapshot(
                app=self._sm.snapshot(),
                sessions=list(self._sessions.values()),
                members=list(self._addresses.values()),
            )
        )

    def _restore(self, image: bytes) -> None:
        if not image:
            return
        snapshot = _snapshot_decoder.decode(image)
        self._sm.restore(snapshot.app)
        self._sessions = {s.client_id: s for s in snapshot.sessions}
        for member in snapshot.members:
            self._learn_address(member)

    async def _maybe_snapshot(self) -> None:
        applied = self._node.applied_index
        if applied - self._last_snapshot < self._settings.snapshot_every:
            return
        image = self._image()
        meta_index = applied
        node = self._node
        term = node.log.term(meta_index)
        if term is None:
            return
        meta = SnapshotMeta(index=meta_index, term=term, conf=node.conf)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._save_snapshot, meta, image, self._last_snapshot)
        node.compact(meta_index, image)
        self._last_snapshot = meta_index
        log.debug("node %d: snapshot at %d (%d bytes)", node.id, meta_index, len(image))

    def _save_snapshot(self, meta: SnapshotMeta, image: bytes, previous: int) -> None:
        self._storage.save_snapshot(meta, image)
        # Keep what recovery to the previous snapshot needs, as a fallback should
        # the new snapshot file turn out damaged; free everything older.
        self._storage.compact(previous)

    def _fail_all(self, error: Exception) -> None:
        for pending in self._pending.values():
            pending.outcome.fail(error)
        for _, _, pending in self._deadlines:  # some may not have reached the node loop
            pending.outcome.fail(error)
        self._deadlines.clear()
        for outcome in self._reads.values():
            outcome.fail(error)
        self._pending.clear()


def _stepper(node: RaftNode, message: RaftPeerMessages) -> Callable[[], None]:
    return lambda: node.step(message)


def _open_storage(data_dir: Path | None, settings: RaftSettings) -> LogStorage:
    if data_dir is None:
        return MemoryStorage()
    return DiskStorage.open(data_dir, fsync=settings.fsync)


def _initial_view(storage: LogStorage, members: Sequence[int], join: bool) -> StorageView:
    state = storage.initial_state()
    if state.snapshot is None and not state.entries and state.hard_state.term == 0 and not join:
        view = bootstrap(sorted(members))
        storage.save(view.hard_state, list(view.entries))
        return view
    if state.snapshot is None:
        return StorageView(hard_state=state.hard_state, entries=tuple(state.entries))
    return StorageView(
        hard_state=state.hard_state,
        entries=tuple(state.entries),
        snapshot=state.snapshot,
        snapshot_data=storage.read_snapshot(),
    )


@asynccontextmanager
async def open_raft_log(
    *,
    node_id: NodeId,
    members: Mapping[NodeId, PeerId],
    transport: Transport,
    data_dir: Path | None,
    state_machine: StateMachine,
    settings: RaftSettings | None = None,
    join: bool = False,
    seed: int | None = None,
) -> AsyncIterator[RaftReplicatedLog]:
    """Run one Raft node until the block exits.

    ``members`` maps the founding voters to their transport peer ids (the caller
    has told the transport their addresses). A new group is bootstrapped from
    them when ``data_dir`` holds no state; a node restarting from ``data_dir``
    takes its membership from there. ``join=True`` starts an empty node that waits
    to be added by the group's leader (``add_learner``).
    """
    settings = settings or RaftSettings()
    storage = await anyio.to_thread.run_sync(_open_storage, data_dir, settings)
    try:
        view = _initial_view(storage, [int(m) for m in members], join)
        config = RaftConfig(
            election_ticks=settings.election_ticks,
            heartbeat_ticks=settings.heartbeat_ticks,
            max_inflight=settings.max_inflight,
            max_batch_bytes=settings.max_batch_bytes,
            quiesce_ticks=settings.quiesce_ticks,
        )
        node = RaftNode(int(node_id), view, config, random.Random(seed))
        peers = {n: p for n, p in members.items() if n != node_id}
        replicated = RaftReplicatedLog(
            node=node,
            storage=storage,
            transport=transport,
            state_machine=state_machine,
            settings=settings,
            peers=peers,
        )
        replicated._restore(view.snapshot_data)
        async with anyio.create_task_group() as tg:
            tg.start_soon(replicated._run, tg)
            try:
                yield replicated
            finally:
                await replicated.aclose()
                tg.cancel_scope.cancel()
    finally:
        storage.close()
