"""Which replicas the front reaches, as they come (start, revival, replacement) and go.

Each replica the front reaches has an upstream and tasks reading its sockets; a
replica counts once it answered a probe. A replica that dies ends the requests in
flight there and wakes the survivors; one that comes back, or joins, has the cells
that wait for a majority settled at once.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from nbos.core.errors import KernelError, NbosError, QuorumLostError
from nbos.kernel import protocol
from nbos.kernel.front._cells import Cells
from nbos.kernel.front._liveness import Liveness
from nbos.kernel.front._relay import Relay
from nbos.kernel.front._upstream import ReplicaEndpoint, Upstream

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
_WAKE_TIMEOUT_S = 5.0


class Membership:
    """Kernel ``kernel_id``'s replicas: ``upstreams``, which this changes (the others
    only read it), their sockets in ``ctx``, read through ``relay``.

    Replicas are reached from :meth:`start` on, in the front's task group.
    """

    def __init__(
        self,
        kernel_id: str,
        *,
        ctx: zmq.asyncio.Context,
        upstreams: dict[int, Upstream],
        liveness: Liveness,
        relay: Relay,
        cells: Cells,
    ) -> None:
        self._kernel_id = kernel_id
        self._ctx = ctx
        self._upstreams = upstreams
        self._liveness = liveness
        self._relay = relay
        self._cells = cells
        self._reader_scopes: dict[int, anyio.CancelScope] = {}
        #: A replica whose process ended -> the survivor asked to campaign for it.
        self._campaigners: dict[int, int] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        liveness.answered = self._answered

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Read every replica in ``tg``; return once each answered or was declared dead.

        Raises :class:`QuorumLostError` if no majority answered.
        """
        self._tg = tg
        for up in self._upstreams.values():
            await tg.start(self._serve_upstream, up)
        # At once: a replica whose host is away must not hold up the others' answers.
        async with anyio.create_task_group() as probes:
            for replica in self._upstreams:
                probes.start_soon(self._probe_at_start, replica)
        if not self._liveness.has_quorum:
            raise QuorumLostError(
                f"kernel {self._kernel_id}: only replicas {self._liveness.alive} of "
                f"{sorted(self._upstreams)} started"
            )

    def watch(self, tg: anyio.abc.TaskGroup) -> None:
        """Watch every replica's heartbeat in ``tg``."""
        for up in self._upstreams.values():
            tg.start_soon(self._liveness.watch, up)

    def replica_died(self, replica: int, reason: str) -> None:
        """End the requests that died with ``replica``, and wake the survivors.

        One only suspected keeps its requests: a frozen executor's cell is not lost
        while it may still finish it (it ends when the replica does, or answers).
        """
        self._relay.end_requests_of(replica, its_own=not self._liveness.unresponsive(replica))
        campaigner = self._campaigners.pop(replica, None)
        if self._tg is not None and not self._liveness.closing:
            # An idle kernel's Raft group may be quiesced: the survivors must time their
            # leader again now (it may be the dead one), not when the next cell comes.
            # Not the one asked to campaign, which that request woke: a replica serves
            # its control requests one at a time, and the settle of a cell lost with
            # the dead one would wait behind the wake.
            for survivor in self._liveness.alive:
                if survivor != campaigner:
                    self._tg.start_soon(self._wake_replica, survivor)

    def process_ended(self, replica: int) -> None:
        """``replica``'s process ended: if it led the Raft group, one survivor campaigns
        now, the one a cell or a settle goes to first (the lowest-numbered: see
        ``LastExecutorChooser``), so the new leader is the next executor. Called before
        the replica is marked dead, so that this request leaves before a settle's.

        Only on proof: a replica that is merely silent may be a live leader, which an
        election would depose for nothing. One survivor only, so that two do not split
        the vote; if it cannot win (its log is behind), the others' election timeouts
        elect one as before.
        """
        up = self._upstreams.get(replica)
        if up is None or self._tg is None or self._liveness.closing:
            return
        if not (up.alive or self._liveness.unresponsive(replica)):
            return  # its end was told already
        survivors = [r for r in self._liveness.alive if r != replica]
        if 2 * len(survivors) > len(self._liveness.voters):
            self._campaigners[replica] = survivors[0]
            self._tg.start_soon(self._campaign_for, survivors[0], replica)

    async def _campaign_for(self, survivor: int, dead: int) -> None:
        reply = await self._relay.control_request(
            survivor,
            protocol.LEADER_GONE_REQUEST,
            {protocol.GONE_NODE: dead},
            timeout=_WAKE_TIMEOUT_S,
        )
        if reply is not None and reply["content"].get(protocol.CAMPAIGNED):
            log.info(
                "kernel %s: replica %d campaigns for the Raft leadership of replica %d",
                self._kernel_id,
                survivor,
                dead,
            )

    async def _wake_replica(self, replica: int) -> None:
        """Any request wakes a replica's Raft member; a kernel_info one is harmless."""
        await self._relay.control_request(
            replica, "kernel_info_request", {}, timeout=_WAKE_TIMEOUT_S
        )

    async def revive(self, replica: int, *, timeout: float) -> None:
        """Use ``replica`` again once it answers (see ``KernelFront.revive``)."""
        up = self._upstreams[replica]
        if up.alive or self._tg is None:
            return
        up.revive()
        # Until our IOPub subscription reached the new process, what a cell printed
        # there would be lost (a SUB socket misses what is published before), its reply
        # and idle not: no cell goes to it before its probe saw both.
        with self._liveness.held_back(replica):
            answered = await self._probe(replica, timeout=timeout)
        if not answered:
            up.mark_dead()
            raise KernelError(f"replica {replica} did not answer within {timeout} s")
        self._liveness.revived(replica)
        self._tg.start_soon(self._liveness.watch, up)
        log.info("kernel %s: replica %d is back", self._kernel_id, replica)
        self._settle_soon()

    def suspect(self, replica: int, reason: str) -> None:
        """Leave ``replica`` out, and use it again once it answers (see ``_liveness``)."""
        up = self._upstreams.get(replica)
        if up is None or self._tg is None:
            return
        watched = up.alive or self._liveness.unresponsive(replica)
        self._liveness.mark_dead(replica, reason, suspicion=True)
        if not watched:
            # Its watcher ended when it was declared dead: ping it again.
            self._tg.start_soon(self._liveness.watch, up)

    def _answered(self, replica: int) -> None:
        if self._tg is not None and not self._liveness.closing:
            self._tg.start_soon(self._revive_answered, replica)

    async def _revive_answered(self, replica: int) -> None:
        try:
            await self.revive(replica, timeout=_WAKE_TIMEOUT_S)
        except KernelError as exc:
            log.info("kernel %s: replica %d answered, then not: %s", self._kernel_id, replica, exc)
            up = self._upstreams.get(replica)
            if up is not None and self._tg is not None and self._liveness.unresponsive(replica):
                self._tg.start_soon(self._liveness.watch, up)

    async def add(self, endpoint: ReplicaEndpoint, *, timeout: float) -> None:
        """Reach a new replica on standby (see ``KernelFront.add_replica``)."""
        replica = endpoint.replica
        if self._tg is None or replica in self._upstreams:
            raise KernelError(f"kernel {self._kernel_id}: cannot add replica {replica}")
        up = Upstream(endpoint, self._ctx)
        self._upstreams[replica] = up
        self._liveness.standby(replica)
        await self._tg.start(self._serve_upstream, up)
        if not await self._probe(replica, timeout=timeout):
            self.remove(replica)
            raise KernelError(f"replica {replica} did not answer within {timeout} s")

    def activate(self, replica: int) -> None:
        """Let cells go to ``replica``, on standby since :meth:`add`."""
        if self._tg is None or not self._liveness.activate(replica):
            return
        self._tg.start_soon(self._liveness.watch, self._upstreams[replica])
        log.info("kernel %s: replica %d joined", self._kernel_id, replica)
        self._settle_soon()

    def remove(self, replica: int) -> None:
        """Forget ``replica`` for good (it was replaced): requests there end as lost."""
        self._liveness.mark_dead(replica, "removed from the kernel")
        self._liveness.forget(replica)
        scope = self._reader_scopes.pop(replica, None)
        if scope is not None:
            scope.cancel()
        self._upstreams.pop(replica, None)
        self._cells.forget(replica)

    def close(self) -> None:
        for up in self._upstreams.values():
            up.close()

    async def _serve_upstream(
        self, up: Upstream, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Read ``up``'s sockets until it is removed (or the front stops); then close them."""
        relay = self._relay
        try:
            with anyio.CancelScope() as scope:
                self._reader_scopes[up.replica] = scope
                async with anyio.create_task_group() as tg:
                    for channel in ("shell", "control"):
                        tg.start_soon(relay.read_replies, up, channel)
                    tg.start_soon(relay.read_iopub, up)
                    tg.start_soon(relay.read_input_requests, up)
                    task_status.started()
        finally:
            up.close()

    async def _probe_at_start(self, replica: int) -> None:
        if not await self._probe(replica, timeout=READY_TIMEOUT_S):
            self._liveness.mark_dead(replica, "it did not answer at start")

    async def _probe(self, replica: int, *, timeout: float) -> bool:
        """Whether ``replica`` answers, probing until it does, it dies or ``timeout`` passes.

        A reply proves its shell works; its idle proves our IOPub subscription reached
        it (a SUB socket misses what is published before that).
        """
        up = self._upstreams[replica]
        with anyio.move_on_after(timeout):
            while up.alive:
                probe = up.signer.new_message("kernel_info_request", {})
                # Not the client's shell request: a probe may run beside a cell.
                pending = await self._relay.roundtrip(
                    replica, "shell", probe, [], grace=0.5, client=False
                )
                if pending.reply is not None and pending.idled.is_set():
                    return True
        return False

    def _settle_soon(self) -> None:
        """A replica is back: settle what waits for a majority now, not at the next cell."""
        if self._cells.has_unsettled and self._liveness.has_quorum and self._tg is not None:
            self._tg.start_soon(self._settle_in_background)

    async def _settle_in_background(self) -> None:
        try:
            await self._cells.settle_unsettled()
        except (NbosError, zmq.ZMQError):
            # The next cell tries again; the front must not go down with this.
            log.exception("kernel %s: settling cells failed", self._kernel_id)
