"""The anyio driver: runs a sans-IO :class:`~nbos.raft.core.RaftNode` over a Transport and storage.

One task owns the node (as etcd-io/raft's node loop does): ticks, peer messages
and client calls reach it through one queue, and it runs each ``Ready`` to the
end (persist in a worker thread, send, apply, advance) before it takes more
input, which is what the core's contract asks. Other tasks only read the
transport, tick, and wait on outcomes that the node loop sets.

What the node loop works with has a module each: a proposal from its call to its
outcome (:mod:`~nbos.raft._proposals`), the client sessions that apply each
proposal once (:mod:`~nbos.raft._client_sessions`), the forwarding of proposals to
the leader (:mod:`~nbos.raft._forwarding`), and the image of the Raft snapshot
(:mod:`~nbos.raft._snapshot_image`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import typing
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    DecodeError,
    LogClosedError,
    ProposalTimeoutError,
    RaftStateMissingError,
    ReplicationError,
    TransportClosedError,
    UnknownPeerError,
)
from nbos.core.ids import NodeId, PeerId
from nbos.core.log_storage import LogStorage
from nbos.core.replicated_log import StateMachine
from nbos.core.transport import Transport
from nbos.core.wire import decode, encode
from nbos.core.wire.log_commands import MemberAddress
from nbos.core.wire.raft import (
    ConfChange,
    RaftAppend,
    RaftDriverMessages,
    RaftForward,
    RaftPeerMessages,
    RaftTransferRequest,
    SnapshotMeta,
)
from nbos.raft._client_sessions import ClientSessions
from nbos.raft._forwarding import Forwarding
from nbos.raft._proposals import Proposals, Step
from nbos.raft._snapshot_image import SnapshotImage
from nbos.raft._waiters import Outcome, Watermark
from nbos.raft.core import RaftConfig, RaftNode, Ready, StorageView, bootstrap
from nbos.raft.storage import DiskStorage, MemoryStorage

log = logging.getLogger(__name__)

T = TypeVar("T")

_PEER_MESSAGES: tuple[type, ...] = typing.get_args(RaftPeerMessages)
_DRIVER_MESSAGES: tuple[type, ...] = typing.get_args(RaftDriverMessages)
#: A Ready with at most this many bytes of entries (and no snapshot) is written on the
#: node loop itself: for a small write, the fsync costs less than the two thread
#: switches of handing it to a worker, and every consensus round has such a write.
_INLINE_PERSIST_BYTES = 64 * 1024


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
        self._settings = settings
        self._peers: dict[int, PeerId] = {int(n): p for n, p in peers.items()}
        self._addresses: dict[int, MemberAddress] = {}
        sessions = ClientSessions(node.id, state_machine)
        self._image = SnapshotImage(state_machine, sessions)
        self._reads: dict[bytes, Outcome[int]] = {}
        self._forwarding = Forwarding(node, sessions, settings.election_ticks)
        # Leadership requests, which the node loop sends after it took its queued input.
        self._outbox: list[RaftDriverMessages] = []
        self._applied = Watermark(node.applied_index)
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Step](10_000)
        self._proposals = Proposals(
            node=node,
            sessions=sessions,
            forwarding=self._forwarding,
            inbox=self._inbox_send,
            learn_address=self._learn_address,
        )
        self._tasks: TaskGroup | None = None
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
        forward: bool = False,
    ) -> bytes:
        """See :class:`~nbos.core.replicated_log.ReplicatedLog`; ``forward=True`` on a
        follower hands the proposal to the leader instead of raising ``NotLeaderError``,
        and keeps doing so across leader changes until it applied here or ``timeout``
        passed (``ProposalTimeoutError``)."""
        pending, step = self._proposals.prepare(data, client_id, seq, forward, None)
        if step is None:
            return await pending.outcome.wait()
        return await self._proposals.enqueue(step, pending, timeout)

    def propose_nowait(
        self,
        data: bytes,
        *,
        on_done: Callable[[Outcome[bytes]], None],
        client_id: str | None = None,
        seq: int | None = None,
        timeout: float = 10.0,
        forward: bool = False,
    ) -> None:
        """:meth:`propose` for a caller on the node's own loop that does not wait there.

        ``on_done`` gets the outcome (its :meth:`~Outcome.result` is what ``propose``
        returns or raises) on that loop the moment it settles: as the entry applies,
        turns of the loop before an awaiting caller would resume.
        """
        pending, step = self._proposals.prepare(data, client_id, seq, forward, on_done)
        if step is None or (unsent := self._proposals.submit(step, pending, timeout)) is None:
            return

        async def send() -> None:
            # A full inbox (a node far behind): the proposal waits for room in a task.
            try:
                await self._inbox_send.send(unsent)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pending.outcome.fail(LogClosedError("the replicated log was closed"))

        assert self._tasks is not None
        self._tasks.start_soon(send)

    async def ask_for_leadership(self) -> None:
        """Ask the leader this node knows of to hand leadership to it (best effort:
        nothing answers, and a leader that cannot does nothing)."""

        def ask() -> None:
            node = self._node
            if node.leader_id is not None and node.leader_id != node.id:
                self._outbox.append(RaftTransferRequest(node.id, node.leader_id, node.term))

        await self._call(ask)

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
        await self._proposals.replicate_address(MemberAddress(int(node), str(peer), address))
        await self._change(ConfChange("add_learner", int(node)))

    async def promote(self, node: NodeId) -> None:
        await self._change(ConfChange("promote", int(node)))

    async def remove(self, node: NodeId) -> None:
        await self._change(ConfChange("remove", int(node)))

    async def transfer_leadership(self, node: NodeId) -> None:
        await self._call(lambda: self._node.transfer_leadership(int(node)))

    async def campaign_for_dead_leader(self, dead: NodeId) -> bool:
        """Campaign at once if ``dead``, whose process is known to have ended, is this
        node's leader; whether it did (:meth:`RaftNode.campaign_for_dead_leader`)."""
        return await self._call(lambda: self._node.campaign_for_dead_leader(int(dead)))

    async def aclose(self) -> None:
        error = LogClosedError("the replicated log was closed")
        self._proposals.close(error)
        for outcome in self._reads.values():
            outcome.fail(error)
        self._forwarding.clear()
        await self._inbox_send.aclose()

    # --- calls into the node loop --------------------------------------------------

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the node loop, between two Ready cycles; re-raises what it raises."""
        if self._proposals.closed:
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

    def _take_transfer_request(self, message: RaftTransferRequest) -> None:
        try:
            self._node.transfer_leadership(message.src)
        except ReplicationError as exc:
            log.debug("node %d: no transfer to %d: %s", self._node.id, message.src, exc)

    async def _flush_outbox(self) -> None:
        forwards = self._forwarding.messages()
        outbox, self._outbox = self._outbox, []
        for forward in forwards:
            await self._send(forward)
        for message in outbox:
            await self._send(message)

    async def _change(self, change: ConfChange) -> None:
        pending = await self._call(functools.partial(self._proposals.propose_conf_change, change))
        await pending.outcome.wait()

    # --- the loops -----------------------------------------------------------------

    async def _run(self, task_group: TaskGroup) -> None:
        self._tasks = task_group
        task_group.start_soon(self._tick_loop)
        task_group.start_soon(self._receive_loop)
        await self._node_loop()

    async def _tick_loop(self) -> None:
        interval = self._settings.tick_ms / 1000
        while True:
            await anyio.sleep(interval)
            self._proposals.expire()
            if self._node.quiesced and not self._forwarding.tracked:
                # nothing to time until an input wakes the node (it has no proposal
                # in flight whose deadline could pass meanwhile)
                self._awake = anyio.Event()
                await self._awake.wait()
                continue
            try:
                self._inbox_send.send_nowait(self._tick)
            except anyio.WouldBlock:
                log.warning("node %d: inbox full, skipping a tick", self._node.id)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    def _tick(self) -> None:
        self._node.tick()
        self._forwarding.tick()

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
            if isinstance(message, RaftForward):
                step = functools.partial(self._forwarding.take, message)
            elif isinstance(message, RaftTransferRequest):
                step = functools.partial(self._take_transfer_request, message)
            else:
                step = functools.partial(self._node.step, message)
            try:
                try:
                    # Not send(), which first lets every other ready task run: a message
                    # is a step of the round in flight, its proposer waiting.
                    self._inbox_send.send_nowait(step)
                except anyio.WouldBlock:  # a full inbox: wait for room (back-pressure)
                    await self._inbox_send.send(step)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    def _parse(self, sender: PeerId, payload: bytes) -> Any:
        try:
            message = decode(payload)
        except DecodeError as exc:
            log.warning("node %d: dropped a bad message from %s: %s", self._node.id, sender, exc)
            return None
        if not isinstance(message, _PEER_MESSAGES + _DRIVER_MESSAGES):
            log.warning("node %d: %s is not a Raft message", self._node.id, type(message).__name__)
            return None
        if isinstance(message, RaftForward | RaftTransferRequest) and message.dst != self._node.id:
            # the core checks this itself for its own messages
            log.warning("node %d: dropping misaddressed %s", self._node.id, type(message).__name__)
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
            if self._forwarding.tracked:
                self._forwarding.follow_leader()
            if self._forwarding.unsent or self._outbox:
                await self._flush_outbox()
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
        # A Ready that only commits is applied first: what it commits is durable on a
        # majority already, and its write (the commit index) is no sync; its proposers
        # hear back before the leader tells the followers.
        commits_only = not rd.entries and rd.snapshot is None
        if commits_only:
            for entry in rd.committed_entries:
                self._proposals.apply(entry)
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
            self._forwarding.settle_restored()
        if not commits_only:
            for entry in rd.committed_entries:
                self._proposals.apply(entry)
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

    async def _send(self, message: RaftPeerMessages | RaftDriverMessages) -> None:
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

    def _learn_address(self, member: MemberAddress) -> None:
        self._addresses[member.node] = member
        if member.node == self._node.id:
            return
        self._peers[member.node] = PeerId(member.peer)
        self._transport.add_peer(PeerId(member.peer), member.address)

    # --- snapshots -------------------------------------------------------------------

    def _restore(self, image: bytes) -> None:
        for member in self._image.restore(image):
            self._learn_address(member)

    async def _maybe_snapshot(self) -> None:
        applied = self._node.applied_index
        if applied - self._last_snapshot < self._settings.snapshot_every:
            return
        image = self._image.encode(self._addresses.values())
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


def _open_storage(data_dir: Path | None, settings: RaftSettings) -> LogStorage:
    if data_dir is None:
        return MemoryStorage()
    return DiskStorage.open(data_dir, fsync=settings.fsync)


def _initial_view(
    storage: LogStorage, members: Sequence[int], join: bool, recover: bool
) -> StorageView:
    state = storage.initial_state()
    empty = state.snapshot is None and not state.entries and state.hard_state.term == 0
    if empty and recover:
        raise RaftStateMissingError("no Raft state to recover from: the data dir is empty")
    if empty and not join:
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


def core_config(settings: RaftSettings) -> RaftConfig:
    """The pure node's configuration from a kernel's ``[raft]`` settings."""
    return RaftConfig(
        election_ticks=settings.election_ticks,
        heartbeat_ticks=settings.heartbeat_ticks,
        max_inflight=settings.max_inflight,
        max_batch_bytes=settings.max_batch_bytes,
        quiesce_ticks=settings.quiesce_ticks,
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
    recover: bool = False,
    seed: int | None = None,
) -> AsyncIterator[RaftReplicatedLog]:
    """Run one Raft node until the block exits.

    ``members`` maps the founding voters to their transport peer ids (the caller
    has told the transport their addresses). A new group is bootstrapped from
    them when ``data_dir`` holds no state; a node restarting from ``data_dir``
    takes its membership from there. ``join=True`` starts an empty node that waits
    to be added by the group's leader (``add_learner``). ``recover=True``: the node ran
    before and restarts from ``data_dir``, which must hold its state; if it holds none
    (its disk lost it), :class:`~nbos.core.errors.RaftStateMissingError` rather than a
    new group or an empty member that would vote again.
    """
    settings = settings or RaftSettings()
    storage = await anyio.to_thread.run_sync(_open_storage, data_dir, settings)
    try:
        view = _initial_view(storage, [int(m) for m in members], join, recover)
        node = RaftNode(int(node_id), view, core_config(settings), random.Random(seed))
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
