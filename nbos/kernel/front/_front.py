"""The kernel front: one Jupyter kernel in front of a kernel's replicas.

Clients connect to the front's five sockets, signed with the front's own key. The
front connects to each replica as a client (each replica has its own key) and
relays, re-signing every message both ways:

* shell requests are handled one at a time, like ipykernel does. An
  ``execute_request`` gets the next ``exec_index`` and goes to the executor the
  :class:`ExecutorChooser` picks; everything else goes to one live replica
  (comm messages too: the replica puts them through the log to all replicas);
* only the replica a request went to is heard on IOPub, and only for that
  request; replicas' own ``status`` messages are dropped and the front publishes
  exactly one ``busy``/``idle`` pair per request, ``idle`` after the replica's
  own ``idle`` (so all of its output has been relayed);
* a cell that waits before it runs (for GPUs, for a migration) shows why as one
  output updated in place (:mod:`._status`), and how long it waited once it starts;
* stdin is relayed between the client and the executor, interrupts go to the
  executor, ``shutdown_request`` to every replica;
* if the executor dies mid-cell, a survivor commits ``Done(index, lost)`` and the
  client gets a ``CellLostError`` reply; nothing is re-run.

The front routes and relays. It composes the sockets clients connect to
(:mod:`._clients`: signing, refusals, one ``busy`` per request), the cell protocol
(:mod:`._cells`: exec indices, claims, settles) and the replicas' liveness
(:mod:`._liveness`: heartbeats, deaths, the majority), and speaks to replicas in the
terms of :mod:`nbos.kernel.protocol`.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from jupyter_client.connect import KernelConnectionInfo

from nbos.core.errors import (
    AuthenticationError,
    DecodeError,
    KernelError,
    NbosError,
    QuorumLostError,
    TransportError,
)
from nbos.core.executor_chooser import CellPlan, ChoiceRequest, ExecutorChooser
from nbos.kernel import protocol
from nbos.kernel.front import _requests, _wire
from nbos.kernel.front._cells import CellRefused, Cells
from nbos.kernel.front._chooser import LastExecutorChooser
from nbos.kernel.front._clients import ClientChannels, FrontIdentity, Incoming
from nbos.kernel.front._liveness import HeartbeatPolicy, Liveness
from nbos.kernel.front._status import WaitStatus
from nbos.kernel.front._upstream import Channel, ReplicaEndpoint, Upstream

log = logging.getLogger(__name__)

#: After a replica's reply, how long to wait for its ``idle`` before going on without it.
#: A live replica always sends one, after all the request's output: a loaded machine can
#: hold it back for seconds, and an idle sent before that output would cut it off the
#: cell. A replica that dies ends the wait at once; this bounds only a lost message.
IDLE_GRACE_S = 30.0
#: After a replica's ``idle``, how long to wait for a reply it has not sent (ipykernel
#: sends none for a request its handler failed on) before the client gets an error.
NO_REPLY_GRACE_S = 10.0
_READY_TIMEOUT_S = 60.0
_FINISHED_KEPT = 256
_SHUTDOWN_TIMEOUT_S = 5.0
_WAKE_TIMEOUT_S = 5.0
#: How long an interrupt that follows its cell waits for the replica's reply.
_INTERRUPT_TIMEOUT_S = 10.0
#: How the topic of a replica's status messages ends (ipykernel's ``kernel.<id>.status``).
_STATUS_TOPIC = b".status"


@attrs.define
class _RunningCell:
    """A client's ``execute_request`` being run, and whether the client interrupted it."""

    msg_id: str
    interrupted: bool = False


@attrs.define(eq=False)
class _Pending:
    """A request relayed to one replica, until its reply and its ``idle`` came back.

    ``replied`` is set by the reply (or, for a message without one, by the idle),
    ``idled`` by the replica's ``idle``, or by the reply once the IOPub messages it
    counts (``published``) were relayed; both by the replica's death (``lost``);
    ``heard`` by whichever of them comes first.
    """

    msg_id: str
    target: int
    idents: list[bytes]
    expects_reply: bool
    #: It is useless without a majority of replicas (a cell, a settle): it ends as lost
    #: once the front loses its majority.
    needs_quorum: bool = False
    reply: _wire.Msg | None = None
    lost: bool = False
    #: The reply went to the client as the request's final answer.
    answered: bool = False
    #: The request is on its way to the replica (its socket took it).
    sent: bool = False
    #: IOPub messages the reply says the replica published for the request before it.
    published: int | None = None
    #: The replica's IOPub messages for the request relayed so far.
    relayed: int = 0
    replied: anyio.Event = attrs.Factory(anyio.Event)
    idled: anyio.Event = attrs.Factory(anyio.Event)
    heard: anyio.Event = attrs.Factory(anyio.Event)

    def got_reply(self, reply: _wire.Msg) -> None:
        self.reply = reply
        self.published = protocol.take_published_count(reply["metadata"])
        self.replied.set()
        self.heard.set()
        self._idle_once_relayed()

    def got_output(self) -> None:
        self.relayed += 1
        self._idle_once_relayed()

    def _idle_once_relayed(self) -> None:
        # Counted messages are sent in order on one socket: relaying that many means
        # relaying those, so nothing of the request is still on its way.
        if self.published is not None and self.relayed >= self.published:
            self.idled.set()

    def got_idle(self) -> None:
        self.idled.set()
        if not self.expects_reply:
            self.replied.set()
        self.heard.set()

    def got_lost(self) -> None:
        self.lost = True
        self.replied.set()
        self.idled.set()
        self.heard.set()


class KernelFront:
    """One Jupyter kernel in front of ``replicas``; run it with :meth:`serve`.

    ``connection_info`` is valid from construction (the sockets are bound then).
    ``identity``: that of an earlier front, whose ports, key and session this one
    takes, so that clients connected to that one go on with this one: a kernel
    restarted, or the same kernel whose front died while its replicas lived on
    (``resume``): then this front goes on from the last cell the replicas committed
    (see :meth:`serve`). Ports that cannot be bound raise
    :class:`~nbos.core.errors.TransportError`.
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaEndpoint],
        *,
        kernel_id: str = "",
        ip: str = "127.0.0.1",
        chooser: ExecutorChooser | None = None,
        heartbeat: HeartbeatPolicy | None = None,
        identity: FrontIdentity | None = None,
        resume: bool = False,
    ) -> None:
        if not replicas:
            raise KernelError("a kernel front needs at least one replica")
        self._kernel_id = kernel_id
        self._ip = ip
        self._resume = resume
        self._chooser: ExecutorChooser = chooser or LastExecutorChooser()
        self._ctx = zmq.asyncio.Context()
        try:
            self._clients = ClientChannels(self._ctx, kernel_id=kernel_id, ip=ip, identity=identity)
        except TransportError:
            self._ctx.destroy(linger=0)
            raise
        self._upstreams = {r.replica: Upstream(r, self._ctx) for r in replicas}
        self._liveness = Liveness(
            kernel_id, self._upstreams, heartbeat or HeartbeatPolicy(), lambda: bool(self._pending)
        )
        # First of the death listeners: requests in flight end before anyone hears of it.
        self._liveness.on_dead(self._replica_died)
        self._cells = Cells(kernel_id, self._liveness, self.control_request)
        self._reader_scopes: dict[int, anyio.CancelScope] = {}
        self._pending: dict[str, _Pending] = {}
        #: Shell requests that finished, and the replica that handled each.
        self._finished: OrderedDict[str, int] = OrderedDict()
        self._active: _Pending | None = None
        #: Set while the chooser picks a cell's executor (it may wait for GPUs).
        self._choosing: anyio.CancelScope | None = None
        #: The cell being run, from its turn on the shell to its reply.
        self._cell: _RunningCell | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        #: The shell request whose ``idle`` is still due (see :meth:`_finish_shell`).
        self._idle_for: _wire.Msg | None = None
        #: The shell queue, and how many requests it held when the last shell request's
        #: idle went out: those are the ones queued behind that request.
        self._shell_queue: MemoryObjectReceiveStream[Incoming] | None = None
        self._queued_at_idle = 0
        #: Set once a client asked the kernel to shut down (every replica was asked too).
        self.shutdown_requested = anyio.Event()

    # --- public -------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The one session id clients see on every message."""
        return self._clients.session_id

    @property
    def connection_info(self) -> KernelConnectionInfo:
        """What a Jupyter client needs to connect (the content of a connection file)."""
        return {
            "transport": "tcp",
            "ip": self._ip,
            "shell_port": self._clients.ports["shell_port"],
            "iopub_port": self._clients.ports["iopub_port"],
            "stdin_port": self._clients.ports["stdin_port"],
            "control_port": self._clients.ports["control_port"],
            "hb_port": self._clients.ports["hb_port"],
            "key": self._clients.key,
            "signature_scheme": "hmac-sha256",
            "kernel_name": "nbos",
        }

    @property
    def identity(self) -> FrontIdentity:
        """What a later front needs to take this kernel over (``takeover``)."""
        return self._clients.identity

    @property
    def alive(self) -> tuple[int, ...]:
        """Node ids of the replicas the front believes alive, ascending."""
        return self._liveness.alive

    @property
    def has_quorum(self) -> bool:
        """Whether a majority of the kernel's replicas is alive (its log can commit)."""
        return self._liveness.has_quorum

    @property
    def refused(self) -> int:
        """How many client messages were refused: unsigned, wrongly signed or malformed
        messages, requests of types the kernel does not serve, bad content."""
        return self._clients.refused

    @property
    def last_executor(self) -> int | None:
        """The replica that ran the last cell (``None`` before the first, or once it died)."""
        return self._cells.last_executor

    @property
    def running_on(self) -> int | None:
        """The replica handling the shell request in flight (the executor during a cell)."""
        return self._active.target if self._active is not None else None

    @property
    def last_exec_index(self) -> int:
        """The ``exec_index`` given to the latest cell (0 before the first)."""
        return self._cells.last_exec_index

    @property
    def settled_exec_index(self) -> int:
        """The ``exec_index`` of the latest cell whose reply went to the client (0 before).

        Its ``Done`` has committed; a cell in flight has a later index.
        """
        return self._cells.settled_exec_index

    @property
    def is_closing(self) -> bool:
        """Whether the kernel is being shut down (:meth:`closing` was called)."""
        return self._liveness.closing

    def closing(self) -> None:
        """The kernel is being shut down: replicas that end from now on are expected to."""
        self._liveness.closing = True

    def on_dead(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(replica, reason)`` whenever the front declares a replica dead.

        Whoever runs the replica's process fences it there: one the front gave up on
        (missed heartbeats) may only be frozen, and must not come back.
        """
        self._liveness.on_dead(listener)

    def mark_dead(self, replica: int, reason: str) -> None:
        """Stop using ``replica``; requests in flight there end as lost."""
        self._liveness.mark_dead(replica, reason)

    def _replica_died(self, replica: int, reason: str) -> None:
        """End the requests that died with ``replica``, and wake the survivors."""
        quorum = self.has_quorum
        for pending in list(self._pending.values()):
            if pending.target == replica or (pending.needs_quorum and not quorum):
                pending.got_lost()
        if self._tg is not None and not self.is_closing:
            # An idle kernel's Raft group may be quiesced: the survivors must time their
            # leader again now (it may be the dead one), not when the next cell comes.
            for survivor in self.alive:
                self._tg.start_soon(self._wake_replica, survivor)

    async def _wake_replica(self, replica: int) -> None:
        """Any request wakes a replica's Raft member; a kernel_info one is harmless."""
        await self.control_request(replica, "kernel_info_request", {}, timeout=_WAKE_TIMEOUT_S)

    async def revive(self, replica: int, *, timeout: float = _READY_TIMEOUT_S) -> None:
        """Use ``replica`` again once it answers: it was restarted after :meth:`mark_dead`.

        Raises :class:`KernelError` if it does not answer within ``timeout``.
        """
        up = self._upstreams[replica]
        if up.alive or self._tg is None:
            return
        up.revive()
        if not await self._probe(replica, timeout=timeout):
            up.mark_dead()
            raise KernelError(f"replica {replica} did not answer within {timeout} s")
        self._tg.start_soon(self._liveness.watch, up)
        log.info("kernel %s: replica %d is back", self._kernel_id, replica)
        self._settle_soon()

    async def control_request(
        self,
        replica: int,
        msg_type: str,
        content: Mapping[str, Any],
        *,
        timeout: float,
        needs_quorum: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> _wire.Msg | None:
        """Send a control request of the front's own to ``replica``; its reply or ``None``.

        ``None`` too when the replica is gone (dead, or removed by a replacement), or,
        for a request that ``needs_quorum``, once no majority of replicas is alive.
        """
        up = self._upstreams.get(replica)
        if up is None:
            return None
        msg = up.signer.new_message(msg_type, dict(content))
        msg["metadata"] = {**msg["metadata"], **(metadata or {})}
        with anyio.move_on_after(timeout):
            pending = await self._roundtrip(
                replica, "control", msg, [], grace=0.0, needs_quorum=needs_quorum
            )
            return pending.reply
        return None

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve clients until cancelled; ``task_status.started()`` once every replica answered."""
        shell_tx, shell_rx = anyio.create_memory_object_stream[Incoming](100)
        control_tx, control_rx = anyio.create_memory_object_stream[Incoming](100)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for up in self._upstreams.values():
                    await tg.start(self._serve_upstream, up)
                await self._wait_ready()
                if self._resume:
                    await self._cells.resume()
                tg.start_soon(self._read_client, self._clients.shell, shell_tx)
                tg.start_soon(self._read_client, self._clients.control, control_tx)
                tg.start_soon(self._read_client_stdin)
                tg.start_soon(self._clients.echo_heartbeats)
                tg.start_soon(self._shell_worker, shell_rx)
                tg.start_soon(self._control_worker, control_rx)
                for up in self._upstreams.values():
                    tg.start_soon(self._liveness.watch, up)
                task_status.started()
        finally:
            self._close()

    async def add_replica(
        self, endpoint: ReplicaEndpoint, *, timeout: float = _READY_TIMEOUT_S
    ) -> None:
        """Start using a new replica (a replacement) once it answers.

        Until :meth:`activate_replica` it is reachable by :meth:`control_request` but
        not :attr:`alive`: no cell goes to it. Raises :class:`KernelError` if it does
        not answer within ``timeout`` (it is removed again then).
        """
        replica = endpoint.replica
        if self._tg is None or replica in self._upstreams:
            raise KernelError(f"kernel {self._kernel_id}: cannot add replica {replica}")
        up = Upstream(endpoint, self._ctx)
        self._upstreams[replica] = up
        self._liveness.standby(replica)
        await self._tg.start(self._serve_upstream, up)
        if not await self._probe(replica, timeout=timeout):
            self.remove_replica(replica)
            raise KernelError(f"replica {replica} did not answer within {timeout} s")

    def activate_replica(self, replica: int) -> None:
        """Let cells go to ``replica``, added by :meth:`add_replica` (a Raft voter by now)."""
        if self._tg is None or not self._liveness.activate(replica):
            return
        self._tg.start_soon(self._liveness.watch, self._upstreams[replica])
        log.info("kernel %s: replica %d joined", self._kernel_id, replica)
        self._settle_soon()

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica`` for good (it was replaced): requests there end as lost."""
        self.mark_dead(replica, "removed from the kernel")
        self._liveness.forget(replica)
        scope = self._reader_scopes.pop(replica, None)
        if scope is not None:
            scope.cancel()
        self._upstreams.pop(replica, None)
        self._cells.forget(replica)

    async def _serve_upstream(
        self, up: Upstream, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Read ``up``'s sockets until it is removed (or the front stops); then close them."""
        try:
            with anyio.CancelScope() as scope:
                self._reader_scopes[up.replica] = scope
                async with anyio.create_task_group() as tg:
                    for channel in ("shell", "control"):
                        tg.start_soon(self._read_replies, up, channel)
                    tg.start_soon(self._read_iopub, up)
                    tg.start_soon(self._read_input_requests, up)
                    task_status.started()
        finally:
            up.close()

    def _close(self) -> None:
        for up in self._upstreams.values():
            up.close()
        self._clients.close()
        self._ctx.term()

    # --- start-up -------------------------------------------------------------------

    async def _wait_ready(self) -> None:
        for replica in self._upstreams:
            if not await self._probe(replica, timeout=_READY_TIMEOUT_S):
                self.mark_dead(replica, "it did not answer at start")
        if not self.has_quorum:
            raise QuorumLostError(
                f"kernel {self._kernel_id}: only replicas {self.alive} of "
                f"{sorted(self._upstreams)} started"
            )

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
                pending = await self._roundtrip(
                    replica, "shell", probe, [], grace=0.5, client=False
                )
                if pending.reply is not None and pending.idled.is_set():
                    return True
        return False

    # --- clients --------------------------------------------------------------------

    async def _read_client(
        self, sock: zmq.asyncio.Socket, tx: MemoryObjectSendStream[Incoming]
    ) -> None:
        while True:
            frames = await sock.recv_multipart()
            incoming = self._clients.parse(frames)
            if incoming is not None:
                self._liveness.request_seen()
                try:
                    # Not send(), which first lets every other ready task run.
                    tx.send_nowait(incoming)
                except anyio.WouldBlock:  # a full queue: stop reading until it has room
                    await tx.send(incoming)

    async def _finish_shell(self) -> None:
        """Publish the shell request's ``idle`` if it is still due.

        That is as soon as its reply was relayed and so was the output the reply counts,
        or the replica's own idle came (:meth:`_finish_if_out`); or else when the
        request is done with.
        """
        parent, self._idle_for = self._idle_for, None
        if parent is not None:
            queue = self._shell_queue
            self._queued_at_idle = 0 if queue is None else queue.statistics().current_buffer_used
            await self._clients.publish_status("idle", parent)

    async def _finish_if_out(self, pending: _Pending) -> None:
        """Publish the idle of the shell request in flight once everything of it is out:
        its reply went to the client and ``idled`` is set (in either order). The
        client need not wait for the request's task to unwind (releasing its plan)."""
        if pending.answered and pending.idled.is_set() and pending is self._active:
            await self._finish_shell()

    # --- shell ----------------------------------------------------------------------

    async def _shell_worker(self, rx: MemoryObjectReceiveStream[Incoming]) -> None:
        self._shell_queue = rx
        async for idents, msg in rx:
            stop = await self._handle_shell(idents, msg, abort=False)
            # As ipykernel does: a cell that fails with stop_on_error aborts the requests
            # queued behind it, not one that the client sent once it saw the cell's idle.
            for _ in range(self._queued_at_idle if stop else 0):
                await self._handle_shell(*rx.receive_nowait(), abort=True)

    async def _handle_shell(self, idents: list[bytes], msg: _wire.Msg, *, abort: bool) -> bool:
        """Handle one shell request; ``True`` if it was a cell whose failure stops the queue."""
        msg_type = msg["header"]["msg_type"]
        self._clients.busy_due(msg)
        self._idle_for = msg
        try:
            if not await self._clients.screen(idents, msg, "shell"):
                return False
            if msg_type != "execute_request":
                await self._relay(idents, msg, "shell", self._clients.shell)
                return False
            if abort:
                await self._clients.reply(idents, msg, "execute_reply", {"status": "aborted"})
                return False
            status = await self._execute(idents, msg)
            content = msg["content"]
            silent = bool(content.get("silent", False))
            return status == "error" and not silent and content.get("stop_on_error", True)
        except (NbosError, zmq.ZMQError, KeyError, TypeError, ValueError):
            # One request gone wrong must not take the kernel's front down with it.
            log.exception("kernel %s: %s failed", self._kernel_id, msg_type)
            return False
        finally:
            await self._finish_shell()

    async def _execute(self, idents: list[bytes], msg: _wire.Msg) -> str:
        """Run one cell; returns the status of the reply the client got."""
        self._cell = _RunningCell(msg["header"]["msg_id"])
        try:
            return await self._execute_cell(idents, msg)
        finally:
            self._cell = None

    async def _execute_cell(self, idents: list[bytes], msg: _wire.Msg) -> str:
        wait = self._wait_status(msg)

        async def choose(index: int) -> CellPlan:
            try:
                plan = await self._choose(msg, index, wait)
            except NbosError:
                await wait.ended(started=False)
                raise
            await wait.ended(started=True)
            return plan

        async def execute(index: int, plan: CellPlan) -> str | None:
            try:
                return await self._execute_on(idents, msg, index, plan)
            finally:
                await self._chooser.release(plan)

        try:
            return await self._cells.run(choose, execute)
        except CellRefused as refused:
            return await self._fail_cell(idents, msg, protocol.error_content(refused.error, 0))

    async def _fail_cell(self, idents: list[bytes], msg: _wire.Msg, content: dict[str, Any]) -> str:
        """Answer a cell with the error reply ``content``; returns its status, ``"error"``.

        The error goes out as the cell's ``error`` output too, as a replica's would: a
        notebook shows a cell's outputs, not its reply.
        """
        error = {k: content[k] for k in ("ename", "evalue", "traceback")}
        await self._clients.publish(self._clients.new_message("error", error, msg))
        await self._clients.reply(idents, msg, "execute_reply", content)
        return "error"

    async def _choose(self, msg: _wire.Msg, index: int, wait: WaitStatus) -> CellPlan:
        """The chooser's plan for cell ``index``; an interrupt ends a wait (for GPUs)."""
        with anyio.CancelScope() as scope:
            self._choosing = scope
            if self._cell is not None and self._cell.interrupted:
                scope.cancel()
            try:
                return await self._chooser.choose(self._choice_request(msg, index, wait))
            finally:
                self._choosing = None
        raise KernelError(f"cell {index} was interrupted while it waited to run")

    def _wait_status(self, msg: _wire.Msg) -> WaitStatus:
        """The status output of cell ``msg`` while it waits to run, updated in place."""

        async def publish(msg_type: str, content: dict[str, Any]) -> None:
            await self._clients.publish(self._clients.new_message(msg_type, content, msg))

        return WaitStatus(publish, f"nbos-wait-{msg['header']['msg_id']}")

    def _choice_request(self, msg: _wire.Msg, index: int, wait: WaitStatus) -> ChoiceRequest:
        code = msg["content"].get("code", "")
        return ChoiceRequest(
            index,
            self.last_executor,
            self.alive,
            code=code if isinstance(code, str) else "",
            metadata=msg["metadata"],
            notify=wait.waits,
        )

    async def _execute_on(
        self, idents: list[bytes], msg: _wire.Msg, index: int, plan: CellPlan
    ) -> str | None:
        """The reply's status, or ``None`` if the replica's claim lost (nothing ran)."""

        async def relay(reply: _wire.Msg) -> bool:
            if protocol.claim_lost(reply["metadata"]):
                return False
            self._cells.ran_on(plan.replica)
            await self._clients.send(self._clients.shell, reply, idents)
            return True

        metadata = protocol.cell_metadata(msg["metadata"], index, plan.devices)
        # The front aborts what is queued behind a failed cell (stop_on_error); a replica
        # doing it too would abort the front's next request, sent after the failure.
        content = {**msg["content"], "stop_on_error": False}
        if plan.code is not None:
            content["code"] = plan.code
        pending = await self._roundtrip(
            plan.replica,
            "shell",
            {**msg, "metadata": metadata, "content": content},
            idents,
            grace=IDLE_GRACE_S,
            on_reply=relay,
            on_sent=self._cell_sent,
            needs_quorum=True,
        )
        if pending.reply is None:
            return await self._cell_lost(idents, msg, index, plan.replica)
        if protocol.claim_lost(pending.reply["metadata"]):
            return None
        return str(pending.reply["content"].get("status", "error"))

    def _settle_soon(self) -> None:
        """A replica is back: settle what waits for a majority now, not at the next cell."""
        if self._cells.has_unsettled and self.has_quorum and self._tg is not None:
            self._tg.start_soon(self._settle_in_background)

    async def _settle_in_background(self) -> None:
        try:
            await self._cells.settle_unsettled()
        except (NbosError, zmq.ZMQError):
            # The next cell tries again; the front must not go down with this.
            log.exception("kernel %s: settling cells failed", self._kernel_id)

    async def _cell_lost(
        self, idents: list[bytes], msg: _wire.Msg, index: int, executor: int
    ) -> str:
        """The executor died before replying: have a survivor settle the cell, tell the client."""
        content = await self._cells.lost(index, executor)
        if content["status"] == "error":
            return await self._fail_cell(idents, msg, content)
        await self._clients.reply(idents, msg, "execute_reply", content)
        return str(content["status"])

    async def _relay(
        self,
        idents: list[bytes],
        msg: _wire.Msg,
        channel: _requests.Channel,
        sock: zmq.asyncio.Socket,
    ) -> None:
        """Relay a request to a live replica (the last executor first) and its reply back."""

        async def relay(reply: _wire.Msg) -> bool:
            await self._clients.send(sock, reply, idents)
            return True

        expects_reply = msg["header"]["msg_type"].endswith("_request")
        last = self._cells.last_executor
        preferred = [last] if last in self.alive else []
        for target in [*preferred, *self.alive]:
            assert target is not None
            pending = await self._roundtrip(
                target, channel, msg, idents, grace=IDLE_GRACE_S, on_reply=relay
            )
            if pending.reply is not None or not expects_reply:
                return  # a comm message may have reached the log; never send it twice
            if not pending.lost:
                self._clients.refuse()
                failure = KernelError(f"replica {target} sent no reply to {msg['msg_type']}")
                log.warning("kernel %s: %s", self._kernel_id, failure)
                await self._clients.reply_error(idents, msg, channel, failure)
                return
        log.warning("kernel %s: no live replica for %s", self._kernel_id, msg["msg_type"])

    async def _roundtrip(
        self,
        target: int,
        channel: Channel,
        msg: _wire.Msg,
        idents: list[bytes],
        *,
        grace: float,
        on_reply: Callable[[_wire.Msg], Awaitable[bool]] | None = None,
        on_sent: Callable[[_Pending], None] | None = None,
        needs_quorum: bool = False,
        client: bool = True,
    ) -> _Pending:
        """Send ``msg`` to ``target`` (then ``on_sent``); wait for its reply (``on_reply``
        gets it at once and says whether it answered the client), then for its idle (at
        most ``grace`` seconds longer). A request that ``needs_quorum`` ends as lost once
        no majority is alive; a shell ``msg`` of a ``client`` is the request in flight
        meanwhile."""
        header = msg["header"]
        expects_reply = header["msg_type"].endswith("_request")
        pending = _Pending(header["msg_id"], target, idents, expects_reply, needs_quorum)
        up = self._upstreams[target]
        if not up.alive or (needs_quorum and not self.has_quorum):
            pending.got_lost()
            return pending
        self._pending[pending.msg_id] = pending
        shell = channel == "shell" and client
        if shell:
            self._active = pending
        try:
            try:
                await up.send(channel, msg)
            except KernelError as exc:
                log.info("kernel %s: %s", self._kernel_id, exc)
                pending.got_lost()
                return pending
            pending.sent = True
            if on_sent is not None:
                on_sent(pending)
            if shell:
                await self._clients.flush_busy()
            await _wait_reply(pending)
            if pending.reply is not None and on_reply is not None:
                # The client may have it before the replica's last output: as with any
                # kernel, a client waits for idle to know a request is complete.
                pending.answered = await on_reply(pending.reply)
                await self._finish_if_out(pending)
            # Everything the replica published for the request is out once the output
            # its reply counts was relayed, or its idle came; past the grace we go on
            # without them (an IOPub message can be lost).
            with anyio.move_on_after(grace) as waited:
                await pending.idled.wait()
            if waited.cancelled_caught and grace >= IDLE_GRACE_S:
                log.warning(
                    "kernel %s: no idle from replica %d for %s %s within %.0f s; going on",
                    self._kernel_id,
                    target,
                    header["msg_type"],
                    pending.msg_id,
                    grace,
                )
        finally:
            self._pending.pop(pending.msg_id, None)
            if self._active is pending:
                self._active = None
            if shell and not pending.lost:
                self._finished[pending.msg_id] = target
                if len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)
        return pending

    # --- control --------------------------------------------------------------------

    async def _control_worker(self, rx: MemoryObjectReceiveStream[Incoming]) -> None:
        async for idents, msg in rx:
            msg_type = msg["header"]["msg_type"]
            await self._clients.publish_status("busy", msg)
            try:
                if await self._clients.screen(idents, msg, "control"):
                    await self._serve_control(idents, msg)
            except (NbosError, zmq.ZMQError, KeyError, TypeError, ValueError):
                log.exception("kernel %s: %s failed", self._kernel_id, msg_type)
            finally:
                await self._clients.publish_status("idle", msg)

    async def _serve_control(self, idents: list[bytes], msg: _wire.Msg) -> None:
        msg_type = msg["header"]["msg_type"]
        if msg_type == "shutdown_request":
            await self._shutdown(idents, msg)
        elif msg_type == "interrupt_request":
            await self._interrupt(idents, msg)
        else:
            await self._relay(idents, msg, "control", self._clients.control)

    async def _interrupt(self, idents: list[bytes], msg: _wire.Msg) -> None:
        """Interrupt the cell in progress where it is: its wait to run, its replica."""
        cell, active = self._cell, self._active
        if cell is None:
            target = active.target if active is not None else self._cells.last_executor
            await self._forward_interrupt(idents, msg, target)
            return
        cell.interrupted = True
        if active is not None and active.sent:
            # The replica may get it before the cell itself (shell and control are not
            # ordered): naming the cell lets it keep the interrupt until the cell comes.
            metadata = protocol.interrupt_metadata(msg["metadata"], cell.msg_id)
            await self._forward_interrupt(idents, {**msg, "metadata": metadata}, active.target)
            return
        if self._choosing is not None:
            # The cell waits for its executor (GPUs): it has not started anywhere yet.
            self._choosing.cancel()
        # Otherwise the cell is not on its way to a replica yet: the interrupt follows it
        # when it is sent (``_cell_sent``).
        reply = self._clients.new_message("interrupt_reply", {"status": "ok"}, msg)
        await self._clients.send(self._clients.control, reply, idents)

    async def _forward_interrupt(
        self, idents: list[bytes], msg: _wire.Msg, target: int | None
    ) -> None:
        if target is None or target not in self.alive:
            target = self.alive[0] if self.alive else None
        if target is None:
            return
        pending = await self._roundtrip(target, "control", msg, idents, grace=IDLE_GRACE_S)
        content = {"status": "ok"} if pending.reply is None else pending.reply["content"]
        reply = self._clients.new_message("interrupt_reply", content, msg)
        await self._clients.send(self._clients.control, reply, idents)

    def _cell_sent(self, pending: _Pending) -> None:
        """The cell is on its way to its replica: an interrupt that came first follows it."""
        cell = self._cell
        if cell is None or not cell.interrupted or self._tg is None:
            return
        self._tg.start_soon(
            functools.partial(
                self.control_request,
                pending.target,
                "interrupt_request",
                {},
                timeout=_INTERRUPT_TIMEOUT_S,
                metadata=protocol.interrupt_metadata({}, cell.msg_id),
            )
        )

    async def _shutdown(self, idents: list[bytes], msg: _wire.Msg) -> None:
        self.closing()
        restart = bool(msg["content"].get("restart", False))
        with anyio.move_on_after(_SHUTDOWN_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for replica in self.alive:
                    tg.start_soon(self._shutdown_one, replica)
        content = {"status": "ok", "restart": restart}
        reply = self._clients.new_message("shutdown_reply", content, msg)
        await self._clients.send(self._clients.control, reply, idents)
        await self._clients.publish(self._clients.new_message("shutdown_reply", content, msg))
        self.shutdown_requested.set()

    async def _shutdown_one(self, replica: int) -> None:
        await self.control_request(
            replica, "shutdown_request", {"restart": False}, timeout=_SHUTDOWN_TIMEOUT_S
        )

    # --- replicas -------------------------------------------------------------------

    async def _read_replies(self, up: Upstream, channel: Channel) -> None:
        sock = up.sockets[channel]
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            if parsed is None:
                continue
            pending = self._pending.get(parsed[1]["parent_header"].get("msg_id", ""))
            if pending is not None and pending.target == up.replica and pending.reply is None:
                pending.got_reply(parsed[1])

    async def _read_iopub(self, up: Upstream) -> None:
        while True:
            frames = await up.receive_iopub()
            if frames[0].endswith(_STATUS_TOPIC) and not self._awaits_idle(up.replica):
                # A status nobody waits for does nothing here: the replica's idle of a
                # request whose reply counted its output, mostly. Not even verified.
                continue
            parsed = self._parse_upstream(up, frames)
            if parsed is None:
                continue
            msg = parsed[1]
            parent_id = msg["parent_header"].get("msg_id", "")
            is_status = msg["header"]["msg_type"] == "status"
            pending = self._pending.get(parent_id)
            if pending is not None and pending.target == up.replica:
                if not is_status:
                    await self._clients.publish(msg)
                    pending.got_output()
                elif msg["content"].get("execution_state") == "idle":
                    pending.got_idle()
                await self._finish_if_out(pending)
            elif not is_status and self._finished.get(parent_id) == up.replica:
                # Late output of a finished request (a thread the cell started), from the
                # replica that ran it: a client shows it with that cell, as with ipykernel.
                await self._clients.publish(msg)

    def _awaits_idle(self, replica: int) -> bool:
        """Whether a request to ``replica`` waits for its idle."""
        return any(p.target == replica and not p.idled.is_set() for p in self._pending.values())

    async def _read_input_requests(self, up: Upstream) -> None:
        sock = up.sockets["stdin"]
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            active = self._active
            if parsed is None or active is None or active.target != up.replica:
                continue
            await self._clients.send(self._clients.stdin, parsed[1], active.idents)

    async def _read_client_stdin(self) -> None:
        while True:
            incoming = self._clients.parse(await self._clients.stdin.recv_multipart())
            active = self._active
            if incoming is None:
                continue
            if active is None or not self._upstreams[active.target].alive:
                log.warning("kernel %s: input_reply with no cell waiting", self._kernel_id)
                continue
            await self._upstreams[active.target].send("stdin", incoming[1])

    def _parse_upstream(self, up: Upstream, frames: list[bytes]) -> Incoming | None:
        try:
            return up.signer.parse(frames)
        except (AuthenticationError, DecodeError) as exc:
            log.warning(
                "kernel %s: replica %d sent a bad message: %s", self._kernel_id, up.replica, exc
            )
            return None


async def _wait_reply(pending: _Pending) -> None:
    """Until ``pending`` has its reply, or its replica went idle without sending one
    (:data:`NO_REPLY_GRACE_S` ago)."""
    # No task per request for the rare idle-first case: every cell waits here.
    await pending.heard.wait()
    if not pending.replied.is_set():
        with anyio.move_on_after(NO_REPLY_GRACE_S):
            await pending.replied.wait()
