"""The replica's Raft member, on its own thread and event loop.

A cell runs on the kernel's main thread and may hold it for minutes; Raft must
keep answering heartbeats meanwhile, so the member lives on a thread of its own
(an anyio blocking portal). Proposals from the kernel's threads cross over with
:meth:`RaftNode.propose`, which any asyncio loop can await.

Only the leader accepts proposals. A follower forwards its proposal to the
leader's *forwarder*, a small ZeroMQ request socket every replica binds next to
its Raft transport, then waits until it has applied the entry itself, so
``propose`` always returns after the entry applied on this node.

With the kernel's CURVE keys (``curve``, see :mod:`nbos.transport.keys`) both the
Raft transport and the forwarder speak CURVE: encrypted, and open only to peers
that hold the kernel's key pair; a peer without it never gets a message through.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import attrs
import zmq
import zmq.asyncio

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    DecodeError,
    LogClosedError,
    MembershipChangeError,
    NotLeaderError,
    ProposalTimeoutError,
    ReplicationError,
)
from nbos.core.ids import KernelId, NodeId, PeerId
from nbos.core.replicated_log import ReplicatedLog, StateMachine
from nbos.core.wire import encode
from nbos.core.wire.entries import KernelEntry
from nbos.kernel.replica._machine import Outcome, decode_outcome
from nbos.raft import RaftReplicatedLog, open_raft_log
from nbos.transport import CurveKeys, ZmqTransport
from nbos.transport.zmq import curve_client, curve_server, start_authenticator

log = logging.getLogger(__name__)

_RETRY_S = 0.02
_FORWARD_TIMEOUT_S = 2.0
#: One read-index attempt: a deposed leader or a dead one never answers it.
_READ_ATTEMPT_S = 1.0
_OK, _REFUSED = b"1", b"0"
_PROPOSE, _TRANSFER = b"P", b"T"

T = TypeVar("T")


@attrs.frozen
class PeerAddress:
    """Where one replica's Raft transport and proposal forwarder listen."""

    raft: str
    forward: str


def peer_id(kernel_id: KernelId, node: NodeId) -> PeerId:
    """The transport peer id of ``node`` in ``kernel_id``'s Raft group."""
    return PeerId(f"{kernel_id}/raft/{node}")


class RaftNode:
    """One kernel replica's Raft member; :meth:`start` it, then :meth:`propose`."""

    def __init__(
        self,
        *,
        kernel_id: KernelId,
        node_id: NodeId,
        peers: Mapping[NodeId, PeerAddress],
        data_dir: Path | None,
        machine: StateMachine,
        settings: RaftSettings,
        join: bool = False,
        curve: CurveKeys | None = None,
    ) -> None:
        # ``join``: a new, empty member (a replacement) that the leader adds as a learner.
        # ``curve``: the kernel's key pair, which every member holds (None: plain TCP).
        if node_id not in peers:
            raise ReplicationError(f"node {node_id} is not among the peers {sorted(peers)}")
        self._kernel_id = kernel_id
        self._node_id = node_id
        self._peers = dict(peers)
        self._data_dir = data_dir
        self._machine = machine
        self._settings = settings
        self._join = join
        self._curve = curve
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._serving: Future[None] | None = None
        #: The member's event loop while it serves (set on its thread before start returns).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log: RaftReplicatedLog | None = None
        self._forwarder: _Forwarder | None = None
        # A process-unique client id lets the log drop a retried proposal's duplicate.
        self._client_id = f"{kernel_id}/{node_id}/{os.getpid()}"
        self._seq = itertools.count(1)
        # The log keeps one session per client id and drops an entry whose seq is below
        # the last applied one, so this client's proposals must commit in seq order.
        self._order: anyio.Lock | None = None

    @property
    def node_id(self) -> NodeId:
        return self._node_id

    @property
    def leader_id(self) -> NodeId | None:
        """The Raft leader this member knows of (a racy read from another thread: a hint)."""
        raft_log = self._log
        return raft_log.leader_id if raft_log is not None else None

    def start(self) -> None:
        """Start the member's thread; returns once the log is open."""
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        self._serving, _ = self._portal.start_task(self._serve, name="raft-node")

    def stop(self) -> None:
        """Stop the member and its thread; pending proposals fail with ``LogClosedError``."""
        if self._serving is not None:
            self._serving.cancel()
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
        self._portal_cm = self._portal = self._serving = self._loop = None

    async def propose(self, entry: KernelEntry, *, timeout: float = 30.0) -> Outcome:
        """Commit ``entry``; returns its outcome once it has applied on this node."""
        return await asyncio.wrap_future(self.propose_soon(entry, timeout=timeout))

    def propose_soon(self, entry: KernelEntry, *, timeout: float = 30.0) -> Future[Outcome]:
        """Hand ``entry`` to the member now, from any thread; the future gets :meth:`propose`'s
        outcome. Unlike a task that calls :meth:`propose`, the proposal does not wait for
        the caller's event loop to get a turn."""
        data = encode(entry)
        # seq is drawn on the Raft thread, under the order lock, so it follows commit order.
        return self._submit(self._propose(data, timeout))

    async def caught_up(self, *, timeout: float = 30.0) -> None:
        """Return once this member has applied every entry committed before the call.

        A read-index barrier: the leader confirms with a majority what its commit
        index is, and this member waits until it has applied that far. A member that
        was frozen or cut off learns here what was decided without it.
        """
        await asyncio.wrap_future(self._submit(self._caught_up(timeout)))

    async def _caught_up(self, timeout: float) -> None:
        assert self._log is not None
        with anyio.move_on_after(timeout):
            while True:
                try:
                    await self._log.read_index(timeout=_READ_ATTEMPT_S)
                except (NotLeaderError, ProposalTimeoutError) as exc:
                    # No leader known yet, or this member was deposed meanwhile.
                    log.debug("read index not confirmed (%s); asking again", exc)
                else:
                    return
                await anyio.sleep(_RETRY_S)
        raise ProposalTimeoutError(f"the kernel log's commit index not confirmed in {timeout} s")

    def wake(self) -> None:
        """Wake the member's Raft group from quiescence, from any thread (a request came)."""
        loop, raft_log = self._loop, self._log
        if loop is None or raft_log is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (stop)
            loop.call_soon_threadsafe(raft_log.wake)

    def want_leadership(self) -> None:
        """Ask the leader, in the background, to hand leadership to this member.

        The executor proposes for every cell (its ``Done``, the next cell's claim); as
        the leader it saves the hop to the leader each time. A refused or lost request
        changes nothing.
        """
        leader = self.leader_id
        if self._loop is None or self._forwarder is None or leader in (None, self._node_id):
            return
        assert leader is not None
        self._submit(self._forwarder.ask_leadership(leader, self._node_id))

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the member's loop; the caller's thread does not wait for that loop.

        The portal's ``start_task_soon`` blocks its caller until the member's loop has
        taken the task, a round trip between threads (0.5 ms and more on a busy host)
        on every proposal; this only queues it. Tasks still running at :meth:`stop`
        are cancelled as the loop ends, which cancels their futures.
        """
        loop = self._loop
        if loop is not None:
            try:
                return asyncio.run_coroutine_threadsafe(coro, loop)
            except RuntimeError:  # the loop closed meanwhile (stop)
                pass
        coro.close()
        raise LogClosedError("the replica's Raft member is not running")

    async def change_members(
        self, op: str, node: NodeId, address: PeerAddress | None
    ) -> tuple[Sequence[NodeId], Sequence[NodeId]]:
        """Make one membership change through this member; the voters and learners after it.

        ``op`` is ``peer`` (only learn ``address``), ``add_learner``, ``promote`` or
        ``remove``. A change already in effect is not made again. Raises
        ``NotLeaderError`` on a follower and ``MembershipChangeError`` when the Raft
        core refuses (another change pending, a learner not caught up yet).
        """
        if self._portal is None:
            raise LogClosedError("the replica's Raft member is not running")
        future = self._portal.start_task_soon(self._change_members, op, node, address)
        return await asyncio.wrap_future(future)

    async def _change_members(
        self, op: str, node: NodeId, address: PeerAddress | None
    ) -> tuple[Sequence[NodeId], Sequence[NodeId]]:
        raft_log, forwarder = self._log, self._forwarder
        assert raft_log is not None and forwarder is not None
        if address is not None:
            forwarder.add_peer(node, address)
        voters, learners = raft_log.voters(), raft_log.learners()
        if op == "add_learner" and node not in (*voters, *learners):
            assert address is not None
            await raft_log.add_learner(node, peer_id(self._kernel_id, node), address.raft)
        elif op == "promote" and node not in voters:
            await raft_log.promote(node)
        elif op == "remove" and node in (*voters, *learners):
            await raft_log.remove(node)
        elif op not in ("peer", "add_learner", "promote", "remove"):
            raise MembershipChangeError(f"unknown membership change {op!r}")
        return raft_log.voters(), raft_log.learners()

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        me = self._peers[self._node_id]
        members = {n: peer_id(self._kernel_id, n) for n in self._peers}
        local = members[self._node_id]
        async with await ZmqTransport.open(local, me.raft, curve=self._curve) as transport:
            for node, address in self._peers.items():
                if node != self._node_id:
                    transport.add_peer(members[node], address.raft)
            async with (
                open_raft_log(
                    node_id=self._node_id,
                    members=members,
                    transport=transport,
                    data_dir=self._data_dir,
                    state_machine=self._machine,
                    settings=self._settings,
                    join=self._join,
                ) as raft_log,
                _Forwarder.open(raft_log, me.forward, self._peers, self._curve) as forwarder,
            ):
                self._log, self._forwarder = raft_log, forwarder
                self._order = anyio.Lock()
                self._loop = asyncio.get_running_loop()
                task_status.started()
                await anyio.sleep_forever()

    async def _propose(self, data: bytes, timeout: float) -> Outcome:
        assert self._order is not None
        async with self._order:
            return await self._propose_in_order(data, next(self._seq), timeout)

    async def _propose_in_order(self, data: bytes, seq: int, timeout: float) -> Outcome:
        assert self._log is not None and self._forwarder is not None
        with anyio.move_on_after(timeout):
            while True:
                try:
                    result = await self._log.propose(data, client_id=self._client_id, seq=seq)
                    return decode_outcome(result)
                except NotLeaderError as exc:
                    leader = exc.leader_hint
                if leader is not None and leader != self._node_id:
                    forwarded = await self._forward(NodeId(leader), seq, data)
                    log.debug("proposal %d forwarded to node %s: %s", seq, leader, forwarded)
                    if forwarded is not None:
                        await self._log.wait_applied(forwarded.index)
                        return forwarded
                # No leader yet (an election is running) or it refused: try again shortly.
                await anyio.sleep(_RETRY_S)
        raise ProposalTimeoutError(f"kernel log entry not committed within {timeout} s")

    async def _forward(self, leader: NodeId, seq: int, data: bytes) -> Outcome | None:
        """Have ``leader`` propose ``data``; ``None`` once it refused, timed out or was deposed.

        A dead leader never answers: rather than wait out the forward timeout, give up as
        soon as this member stops believing in it (the election started), which is
        about an election timeout after it died.
        """
        assert self._log is not None and self._forwarder is not None
        raft_log, forwarder = self._log, self._forwarder
        answer: Outcome | None = None

        async def ask(scope: anyio.CancelScope) -> None:
            nonlocal answer
            answer = await forwarder.ask(leader, self._client_id, seq, data)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, tg.cancel_scope)
            # The log offers no event for a change of leader: poll it.
            while raft_log.leader_id == leader:  # noqa: ASYNC110
                await anyio.sleep(_RETRY_S)
            tg.cancel_scope.cancel()
        return answer


class _Forwarder:
    """Accepts proposals from follower replicas and forwards ours to the leader.

    Request frames: ``[request id, b"P", client id, seq, data]`` (propose) or
    ``[request id, b"T", node]`` (hand leadership to ``node``); reply frames:
    ``[request id, ok flag, outcome]`` (no reply to a transfer).
    """

    def __init__(
        self, raft_log: ReplicatedLog, ctx: zmq.asyncio.Context, curve: CurveKeys | None
    ) -> None:
        self._log = raft_log
        self._ctx = ctx
        self._curve = curve
        self._dealers: dict[NodeId, zmq.asyncio.Socket] = {}
        self._waiting: dict[bytes, asyncio.Future[Outcome | None]] = {}
        self._ids = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None

    def add_peer(self, node: NodeId, address: PeerAddress) -> None:
        """Connect to ``node``'s forwarder (once: a node id's addresses never change)."""
        if node in self._dealers:
            return
        assert self._tg is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            curve_client(dealer, self._curve, None)
        dealer.connect(address.forward)
        self._dealers[node] = dealer
        self._tg.start_soon(self._read_replies, dealer)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        raft_log: ReplicatedLog,
        bind: str,
        peers: Mapping[NodeId, PeerAddress],
        curve: CurveKeys | None,
    ) -> AsyncIterator[_Forwarder]:
        ctx = zmq.asyncio.Context()
        # ZAP first: the ROUTER must not accept a connection before it can be vetted.
        auth = start_authenticator(ctx, f"forwarder at {bind}", curve) if curve else None
        forwarder = cls(raft_log, ctx, curve)
        router = ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve_server(router, curve)
            router.bind(bind)
            async with anyio.create_task_group() as tg:
                forwarder._tg = tg
                for node, address in peers.items():
                    forwarder.add_peer(node, address)
                tg.start_soon(forwarder._serve, router, tg)
                yield forwarder
                tg.cancel_scope.cancel()
        finally:
            for sock in (router, *forwarder._dealers.values()):
                sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()

    async def ask(self, leader: NodeId, client_id: str, seq: int, data: bytes) -> Outcome | None:
        """Have ``leader`` propose ``data``; ``None`` if it refused or did not answer in time."""
        dealer = self._dealers.get(leader)
        if dealer is None:
            return None
        request_id = struct.pack(">Q", next(self._ids))
        waiter: asyncio.Future[Outcome | None] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        try:
            await dealer.send_multipart(
                [request_id, _PROPOSE, client_id.encode(), struct.pack(">Q", seq), data],
                copy=False,
            )
            with anyio.move_on_after(_FORWARD_TIMEOUT_S):
                return await waiter
            return None
        finally:
            self._waiting.pop(request_id, None)

    async def ask_leadership(self, leader: NodeId, node: NodeId) -> None:
        """Ask ``leader`` to hand leadership to ``node`` (best effort, no answer)."""
        dealer = self._dealers.get(leader)
        if dealer is not None:
            await dealer.send_multipart([b"", _TRANSFER, struct.pack(">Q", node)])

    async def _read_replies(self, dealer: zmq.asyncio.Socket) -> None:
        while True:
            frames = await dealer.recv_multipart()
            waiter = self._waiting.get(frames[0]) if len(frames) == 3 else None
            if waiter is None or waiter.done():
                continue
            try:
                waiter.set_result(decode_outcome(frames[2]) if frames[1] == _OK else None)
            except DecodeError as exc:
                log.warning("bad forwarded outcome: %s", exc)
                waiter.set_result(None)

    async def _serve(self, router: zmq.asyncio.Socket, tg: anyio.abc.TaskGroup) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) == 6 and frames[2] == _PROPOSE:
                tg.start_soon(self._answer, router, frames)
            elif len(frames) == 4 and frames[2] == _TRANSFER:
                tg.start_soon(self._transfer, frames[3])
            else:
                log.warning("forwarder request with %d frames dropped", len(frames))

    async def _answer(self, router: zmq.asyncio.Socket, frames: list[Any]) -> None:
        ident, request_id, _, client_id, seq, data = frames
        try:
            result = await self._log.propose(
                bytes(data),
                client_id=bytes(client_id).decode(),
                seq=struct.unpack(">Q", seq)[0],
                timeout=_FORWARD_TIMEOUT_S,
            )
            reply = [ident, request_id, _OK, result]
        except (ReplicationError, UnicodeDecodeError, struct.error) as exc:
            log.debug("forwarded proposal refused: %s", exc)
            reply = [ident, request_id, _REFUSED, b""]
        await router.send_multipart(reply)

    async def _transfer(self, node: bytes) -> None:
        try:
            await self._log.transfer_leadership(NodeId(struct.unpack(">Q", node)[0]))
        except (ReplicationError, struct.error) as exc:
            log.debug("leadership transfer refused: %s", exc)
