"""Proposals from the caller's call to their outcome.

A proposal gets a client session ``(client_id, seq)`` (this log's own next one when
the caller brings none), goes to the node loop through its inbox with a deadline,
and waits for its entry: the apply of that entry settles it with the state
machine's result, or fails it if another leader's entry took its index.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from nbos.core.errors import LogClosedError, NotLeaderError
from nbos.core.wire.log_commands import MemberAddress, Proposal
from nbos.core.wire.raft import ConfChange, Entry
from nbos.raft._client_sessions import ClientSessions
from nbos.raft._forwarding import Forwarding
from nbos.raft._waiters import Outcome, PendingProposal
from nbos.raft.core import RaftNode

log = logging.getLogger(__name__)

_command_decoder = msgspec.msgpack.Decoder(Proposal | MemberAddress)
_encoder = msgspec.msgpack.Encoder()

Step = Callable[[], None]


class Proposals:
    """This log's proposals in flight: their waiters, by log index once appended, and
    their deadlines. Entries apply through here, which settles their proposers."""

    def __init__(
        self,
        *,
        node: RaftNode,
        sessions: ClientSessions,
        forwarding: Forwarding,
        inbox: MemoryObjectSendStream[Step],
        learn_address: Callable[[MemberAddress], None],
    ) -> None:
        self._node = node
        self._sessions = sessions
        self._forwarding = forwarding
        self._inbox = inbox
        self._learn_address = learn_address
        self._client_id = f"node-{node.id}-{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self._pending: dict[int, PendingProposal] = {}
        # (deadline, tiebreak, proposal): the tick loop fails the overdue ones
        self._deadlines: list[tuple[float, int, PendingProposal]] = []
        self._tiebreak = itertools.count()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def prepare(
        self,
        data: bytes,
        client_id: str | None,
        seq: int | None,
        forward: bool,
        on_done: Callable[[Outcome[bytes]], None] | None,
    ) -> tuple[PendingProposal, Step | None]:
        """A proposal's waiter and the step that proposes it on the node loop (``None``:
        a retry of what applied already, settled at once with the first result).
        Without ``client_id`` and ``seq`` it is this log's own next one."""
        if client_id is None or seq is None:
            self._seq += 1
            client_id, seq = self._client_id, self._seq
        pending = PendingProposal(client_id, seq, on_done=on_done)
        result = self._sessions.last_result(client_id, seq)
        if result is not None:
            pending.outcome.set(result)
            return pending, None
        proposal = Proposal(client_id, seq, data)
        if forward:
            return pending, functools.partial(self._forwarding.track, proposal, pending)
        return pending, self._appender(proposal, pending)

    def submit(self, step: Step, pending: PendingProposal, timeout: float) -> Step | None:
        """Queue ``step`` for the node loop, ``pending`` failing after ``timeout``;
        returns ``step`` if the inbox is full (the caller sends it once there is room).

        This is the hot path under load, so it avoids a cancel scope and timer per
        proposal: the deadline goes on a heap that the tick loop sweeps (so it is
        kept to within a tick), and ``step`` fails on refusal the same outcome that
        the apply sets.
        """
        if self._closed:
            pending.outcome.fail(LogClosedError("the replicated log was closed"))
            return None
        pending.timeout = timeout
        deadline = time.monotonic() + timeout
        heapq.heappush(self._deadlines, (deadline, next(self._tiebreak), pending))
        try:
            self._inbox.send_nowait(step)
        except anyio.WouldBlock:
            return step
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pending.outcome.fail(LogClosedError("the replicated log was closed"))
        return None

    async def enqueue(self, step: Step, pending: PendingProposal, timeout: float) -> bytes:
        """Run ``step`` on the node loop and wait for ``pending``, in one trip."""
        unsent = self.submit(step, pending, timeout)
        if unsent is not None:
            try:
                await self._inbox.send(unsent)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise LogClosedError("the replicated log was closed") from None
        return await pending.outcome.wait()

    def expire(self) -> None:
        now = time.monotonic()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][2].outcome.done):
            heapq.heappop(heap)[2].expire()

    async def replicate_address(self, member: MemberAddress) -> None:
        self._seq += 1
        pending = PendingProposal(self._client_id, self._seq)
        await self.enqueue(self._appender(member, pending), pending, timeout=10.0)

    def propose_conf_change(self, change: ConfChange) -> PendingProposal:
        """On the node loop: propose ``change``; the waiter settles as it applies."""
        pending = PendingProposal("", 0)
        self._pending[self._node.propose_conf_change(change)] = pending
        return pending

    def apply(self, entry: Entry) -> None:
        """Apply a committed entry, and settle the proposal that waits on its index."""
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

    def close(self, error: Exception) -> None:
        """Take no more proposals, and fail those in flight with ``error``."""
        # Closed first: a waiter told of the close may propose again (propose_nowait).
        self._closed = True
        for pending in self._pending.values():
            pending.outcome.fail(error)
        for _, _, pending in self._deadlines:  # some may not have reached the node loop
            pending.outcome.fail(error)
        self._deadlines.clear()
        self._pending.clear()

    def _appender(self, command: Proposal | MemberAddress, pending: PendingProposal) -> Step:
        """What appends ``command`` on the node loop as the leader (a follower refuses)."""
        payload = _encoder.encode(command)

        def append() -> None:
            try:
                self._pending[self._node.propose(payload)] = pending
            except Exception as exc:
                pending.outcome.fail(exc)

        return append

    def _apply_command(self, index: int, command: Proposal | MemberAddress) -> bytes:
        if isinstance(command, MemberAddress):
            self._learn_address(command)
            return b""
        session = self._sessions.apply(index, command)
        if session is None:
            # A retry of something already applied: the first result stands.
            return self._sessions.result(command.client_id, command.seq) or b""
        if self._forwarding.tracked:
            self._forwarding.settle(session)
        return session.result
