"""The replica's Raft member, on its own thread and event loop.

A cell runs on the kernel's main thread and may hold it for minutes; Raft must
keep answering heartbeats meanwhile, so the member lives on a thread of its own
(an anyio blocking portal). Proposals from the kernel's threads cross over with
:meth:`RaftMemberThread.propose`, which any asyncio loop can await.

Any member takes proposals: the Raft driver forwards a follower's to the leader over
the Raft transport (``forward=True``), and ``propose`` returns once the entry applied
on this node.

With the kernel's CURVE keys (``curve``, see :mod:`nbos.transport.keys`) the Raft
transport is ZeroMQ speaking CURVE: encrypted, and open only to peers that hold the
kernel's key pair; a peer without it never gets a message through. Without keys it is
plain TCP on the member's loop (:func:`nbos.transport.open_transport`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import attrs

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    LogClosedError,
    MembershipChangeError,
    NotLeaderError,
    ProposalTimeoutError,
    ReplicationError,
)
from nbos.core.ids import KernelId, NodeId, PeerId
from nbos.core.replicated_log import StateMachine
from nbos.core.wire import encode
from nbos.core.wire.entries import KernelEntry
from nbos.kernel.replica._machine import Outcome, decode_outcome
from nbos.raft import Outcome as RaftOutcome
from nbos.raft import RaftReplicatedLog, open_raft_log
from nbos.transport import CurveKeys, open_transport

log = logging.getLogger(__name__)

_RETRY_S = 0.02
#: One read-index attempt: a deposed leader or a dead one never answers it.
_READ_ATTEMPT_S = 1.0

T = TypeVar("T")

#: How long the kernel's thread waits for the member blocked, before it goes back to
#: its event loop to wait: a round takes a few ms, and the loop serves nothing
#: meanwhile that cannot wait this long (see :func:`_result`).
BLOCKING_WAIT_S = 0.02


async def _result(future: Future[T]) -> T:
    """What the member's ``future`` returns, for a coroutine on the kernel's thread.

    Awaited through its event loop, a result set on the member's thread reaches the
    waiting coroutine in about 250 µs: a write to the loop's wake-up pipe, the loop's
    wake, two loop turns, and the GIL, which the member thread keeps while it goes on
    with the round. Waiting blocked on the future for up to :data:`BLOCKING_WAIT_S`
    first, with the member handing over the GIL as it sets the result, takes about
    30 µs; each cell's ``Done`` pays it. The kernel's loop is held meanwhile; its
    shell handles one request at a time anyway, and the rest waits a few ms at most.
    """
    future.add_done_callback(_hand_over_the_gil)
    try:
        return future.result(timeout=BLOCKING_WAIT_S)
    except concurrent.futures.TimeoutError:
        pass
    except concurrent.futures.CancelledError:  # the member stopped (stop)
        raise LogClosedError("the replica's Raft member stopped") from None
    # Not asyncio.wrap_future: it turns the member's cancellation into a CancelledError
    # here, which would pass for the cancellation of the waiting task itself.
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def copy_over(done: Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the waiting loop closed meanwhile
            loop.call_soon_threadsafe(_copy_outcome, done, waiter)

    future.add_done_callback(copy_over)
    return await waiter


def _settle(applied: Future[bytes], outcome: RaftOutcome[bytes]) -> None:
    """Give the kernel's thread a proposal's ``outcome`` (on the member's thread)."""
    # The waiter may have given up (cancelled) meanwhile, on its own thread.
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        try:
            result = outcome.result()
        except Exception as exc:  # the proposal's error is the caller's
            applied.set_exception(exc)
        else:
            applied.set_result(result)


@attrs.frozen
class _Queued:
    """A proposal of the kernel's thread, and the future it waits on."""

    data: bytes
    timeout: float
    applied: Future[bytes]


def _copy_outcome(done: Future[T], waiter: asyncio.Future[T]) -> None:
    if waiter.done():  # the waiting task was cancelled
        return
    if done.cancelled():  # the member stopped (stop)
        waiter.set_exception(LogClosedError("the replica's Raft member stopped"))
    elif (error := done.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(done.result())


def _hand_over_the_gil(_: Future[Any]) -> None:
    # Runs on the thread that set the result; sleeping releases the GIL, which the
    # waiting thread, woken by the same result, takes first.
    time.sleep(0)


def peer_id(kernel_id: KernelId, node: NodeId) -> PeerId:
    """The transport peer id of ``node`` in ``kernel_id``'s Raft group."""
    return PeerId(f"{kernel_id}/raft/{node}")


class RaftMemberThread:
    """One kernel replica's Raft member on its own thread; :meth:`start` it, then
    :meth:`propose`. ``peers`` maps every member to its Raft transport's address."""

    def __init__(
        self,
        *,
        kernel_id: KernelId,
        node_id: NodeId,
        peers: Mapping[NodeId, str],
        data_dir: Path | None,
        machine: StateMachine,
        settings: RaftSettings,
        join: bool = False,
        recover: bool = False,
        curve: CurveKeys | None = None,
    ) -> None:
        # ``join``: a new, empty member (a replacement) that the leader adds as a learner;
        # ``recover``: a member restarted in place, which refuses to start without its state.
        if node_id not in peers:
            raise ReplicationError(f"node {node_id} is not among the peers {sorted(peers)}")
        self._kernel_id = kernel_id
        self._node_id = node_id
        self._peers = dict(peers)
        self._data_dir = data_dir
        self._machine = machine
        self._settings = settings
        self._join = join
        self._recover = recover
        # The kernel's key pair, which every member holds (None: plain TCP).
        self._curve = curve
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._serving: Future[None] | None = None
        #: The member's event loop while it serves (set on its thread before start returns).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log: RaftReplicatedLog | None = None
        # A process-unique client id lets the log drop a retried proposal's duplicate.
        self._client_id = f"{kernel_id}/{node_id}/{os.getpid()}"
        self._seq = itertools.count(1)
        # The log keeps one session per client id and drops an entry whose seq is below
        # the last applied one, so this client's proposals must commit in seq order:
        # one is in flight at a time, the others wait here (on the member's loop).
        self._queued: deque[_Queued] = deque()
        self._in_flight = False
        #: What callers wait on, until settled: a stop cancels what is left (LogClosedError).
        self._waited: set[Future[bytes]] = set()

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
        self._serving, _ = self._portal.start_task(self._serve, name="raft-member")

    def stop(self) -> None:
        """Stop the member and its thread; pending proposals fail with ``LogClosedError``."""
        if self._serving is not None:
            self._serving.cancel()
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
        self._portal_cm = self._portal = self._serving = self._loop = None
        # Queued, or handed over as the loop ended: nothing will settle them now.
        for applied in list(self._waited):
            applied.cancel()

    async def propose(self, entry: KernelEntry, *, timeout: float = 30.0) -> Outcome:
        """Commit ``entry``; returns its outcome once it has applied on this node."""
        loop = self._loop
        if loop is None:
            raise LogClosedError("the replica's Raft member is not running")
        queued = _Queued(encode(entry), timeout, Future())
        self._waited.add(queued.applied)
        queued.applied.add_done_callback(self._waited.discard)
        try:
            # Not a task on the member's loop: a callback, a turn of that loop sooner.
            loop.call_soon_threadsafe(self._enqueue, queued)
        except RuntimeError:  # the loop closed meanwhile (stop)
            queued.applied.cancel()
            raise LogClosedError("the replica's Raft member is not running") from None
        return decode_outcome(await _result(queued.applied))

    async def caught_up(self, *, timeout: float = 30.0) -> None:
        """Return once this member has applied every entry committed before the call.

        A read-index barrier: the leader confirms with a majority what its commit
        index is, and this member waits until it has applied that far. A member that
        was frozen or cut off learns here what was decided without it.
        """
        await _result(self._submit(self._caught_up(timeout)))

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
        raft_log = self._log
        if raft_log is None or self.leader_id in (None, self._node_id):
            return
        self._submit(raft_log.ask_for_leadership())

    async def campaign_for_dead_leader(self, dead: NodeId) -> bool:
        """Campaign at once if ``dead``, whose process ended, led this member's group;
        whether it did (the front asks one survivor on proof of a replica's death)."""
        raft_log = self._log
        if raft_log is None:
            raise LogClosedError("the replica's Raft member is not running")
        return await _result(self._submit(raft_log.campaign_for_dead_leader(dead)))

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
        self, op: str, node: NodeId, address: str | None
    ) -> tuple[Sequence[NodeId], Sequence[NodeId]]:
        """Make one membership change through this member; the voters and learners after it.

        ``op`` is ``add_learner`` (at Raft ``address``), ``promote`` or ``remove``, or
        ``members`` (no change: the leader's account). A change already in effect is not
        made again. Raises ``NotLeaderError`` on a follower and ``MembershipChangeError``
        when the Raft core refuses (another change pending, a learner not caught up yet).
        """
        if self._portal is None:
            raise LogClosedError("the replica's Raft member is not running")
        future = self._portal.start_task_soon(self._change_members, op, node, address)
        return await asyncio.wrap_future(future)

    async def _change_members(
        self, op: str, node: NodeId, address: str | None
    ) -> tuple[Sequence[NodeId], Sequence[NodeId]]:
        raft_log = self._log
        assert raft_log is not None
        voters, learners = raft_log.voters(), raft_log.learners()
        if op == "add_learner" and node not in (*voters, *learners):
            assert address is not None
            await raft_log.add_learner(node, peer_id(self._kernel_id, node), address)
        elif op == "promote" and node not in voters:
            await raft_log.promote(node)
        elif op == "remove" and node in (*voters, *learners):
            await raft_log.remove(node)
        elif op == "members" and raft_log.leader_id != raft_log.node_id:
            # A follower's configuration may lag the leader's.
            raise NotLeaderError(raft_log.leader_id)
        elif op not in ("add_learner", "promote", "remove", "members"):
            raise MembershipChangeError(f"unknown membership change {op!r}")
        return raft_log.voters(), raft_log.learners()

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        members = {n: peer_id(self._kernel_id, n) for n in self._peers}
        bind = self._peers[self._node_id]
        local = members[self._node_id]
        async with await open_transport(local, bind, curve=self._curve) as transport:
            for node, address in self._peers.items():
                if node != self._node_id:
                    transport.add_peer(members[node], address)
            async with open_raft_log(
                node_id=self._node_id,
                members=members,
                transport=transport,
                data_dir=self._data_dir,
                state_machine=self._machine,
                settings=self._settings,
                join=self._join,
                recover=self._recover,
            ) as raft_log:
                self._log = raft_log
                self._loop = asyncio.get_running_loop()
                task_status.started()
                await anyio.sleep_forever()

    def _enqueue(self, queued: _Queued) -> None:
        """On the member's loop: propose ``queued`` once the proposals before it applied."""
        self._queued.append(queued)
        if not self._in_flight:
            self._propose_next()

    def _propose_next(self) -> None:
        raft_log = self._log
        assert raft_log is not None
        while self._queued:
            queued = self._queued.popleft()
            if queued.applied.done():  # its caller gave up
                continue
            self._in_flight = True
            # seq is drawn here, in the order proposals go out, so it follows commit order.
            raft_log.propose_nowait(
                queued.data,
                client_id=self._client_id,
                seq=next(self._seq),
                timeout=queued.timeout,
                forward=True,
                on_done=functools.partial(self._settled, queued.applied),
            )
            return
        self._in_flight = False

    def _settled(self, applied: Future[bytes], outcome: RaftOutcome[bytes]) -> None:
        # On the member's loop, as the entry applied (or the proposal failed).
        _settle(applied, outcome)
        self._propose_next()
