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

Every message to clients carries the front's session id. A client message that
is unsigned, wrongly signed or malformed is refused with a log line; a signed
request of a type the kernel does not serve is logged and ignored, one with bad
content gets an error reply (:mod:`._requests`), and the channel goes on.
"""

from __future__ import annotations

import logging
import secrets
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
    CellLostError,
    DecodeError,
    KernelError,
    NbosError,
    QuorumLostError,
    TransportError,
)
from nbos.kernel import protocol
from nbos.kernel.front import _requests, _wire
from nbos.kernel.front._chooser import (
    CellPlan,
    ChoiceRequest,
    ExecutorChooser,
    LastExecutorChooser,
)
from nbos.kernel.front._status import WaitStatus
from nbos.kernel.front._upstream import Channel, ReplicaEndpoint, Upstream
from nbos.metrics import events

log = logging.getLogger(__name__)

#: After a replica's reply, how long to wait for its ``idle`` before going on without it.
IDLE_GRACE_S = 2.0
#: After a replica's ``idle``, how long to wait for a reply it has not sent (ipykernel
#: sends none for a request its handler failed on) before the client gets an error.
NO_REPLY_GRACE_S = 10.0
_READY_TIMEOUT_S = 60.0
_LOST_TIMEOUT_S = 30.0
_CLAIM_ATTEMPTS = 3
_FINISHED_KEPT = 256
_SHUTDOWN_TIMEOUT_S = 5.0
_WAKE_TIMEOUT_S = 5.0

_Incoming = tuple[list[bytes], _wire.Msg]


@attrs.frozen
class HeartbeatPolicy:
    """How the front pings each replica's heartbeat socket, and when it gives up on one.

    A replica is dead after ``misses`` pings in a row got no echo within ``timeout_s``.
    The heartbeat runs on its own thread in the replica, so a long cell does not miss.

    An idle kernel (no client request and none in flight for ``idle_interval_s``) is
    pinged every ``idle_interval_s`` instead of every ``interval_s``, until the next
    request or a missed ping: a replica's process exit is reported at once by whoever
    runs it, so the pings only look for replicas that hang (``idle_interval_s`` at or
    below ``interval_s``: no back-off).
    """

    interval_s: float = 1.0
    timeout_s: float = 2.0
    misses: int = 3
    idle_interval_s: float = 10.0


@attrs.define(eq=False)
class _Pending:
    """A request relayed to one replica, until its reply and its ``idle`` came back.

    ``replied`` is set by the reply (or, for a message without one, by the idle),
    ``idled`` by the replica's ``idle``; both by the replica's death (``lost``).
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
    replied: anyio.Event = attrs.Factory(anyio.Event)
    idled: anyio.Event = attrs.Factory(anyio.Event)

    def got_reply(self, reply: _wire.Msg) -> None:
        self.reply = reply
        self.replied.set()

    def got_idle(self) -> None:
        self.idled.set()
        if not self.expects_reply:
            self.replied.set()

    def got_lost(self) -> None:
        self.lost = True
        self.replied.set()
        self.idled.set()


@attrs.frozen
class FrontIdentity:
    """What clients know a front by: its key, session id and ports (``shell_port`` ...).

    ``session`` ``None``: a new one (a restarted kernel is a new session).
    """

    key: str
    session: str | None
    ports: Mapping[str, int]


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
        self._key = identity.key if identity is not None else secrets.token_hex(32)
        self._signer = _wire.Signer(
            {"key": self._key},
            username="nbos",
            session_id=identity.session if identity is not None else None,
        )
        self._chooser: ExecutorChooser = chooser or LastExecutorChooser()
        self._heartbeat = heartbeat or HeartbeatPolicy()
        self._ctx = zmq.asyncio.Context()
        ports = identity.ports if identity is not None else {}
        try:
            self._shell = self._bind(zmq.ROUTER, ports.get("shell_port", 0))
            self._control = self._bind(zmq.ROUTER, ports.get("control_port", 0))
            self._stdin = self._bind(zmq.ROUTER, ports.get("stdin_port", 0))
            self._iopub = self._bind(zmq.PUB, ports.get("iopub_port", 0))
            self._hb = self._bind(zmq.ROUTER, ports.get("hb_port", 0))
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise TransportError(f"kernel {kernel_id}: cannot bind its front: {exc}") from exc
        # Kept apart from the sockets: the gateway records a kernel's ports (its state file)
        # even while the kernel stops and its sockets are closed.
        self._ports = {
            "shell_port": _bound_port(self._shell),
            "iopub_port": _bound_port(self._iopub),
            "stdin_port": _bound_port(self._stdin),
            "control_port": _bound_port(self._control),
            "hb_port": _bound_port(self._hb),
        }
        self._upstreams = {r.replica: Upstream(r, self._ctx) for r in replicas}
        #: Replicas being added (replacements): reachable, but not used for cells yet.
        self._standby: set[int] = set()
        self._reader_scopes: dict[int, anyio.CancelScope] = {}
        self._pending: dict[str, _Pending] = {}
        #: Shell requests that finished, and the replica that handled each.
        self._finished: OrderedDict[str, int] = OrderedDict()
        self._active: _Pending | None = None
        #: Set while the chooser picks a cell's executor (it may wait for GPUs).
        self._choosing: anyio.CancelScope | None = None
        self._next_index = 1
        #: Indices whose settle (``Done(index, lost)``) found no majority: each is settled
        #: again, in order, before the next cell (which could not run before it anyway).
        self._unsettled: set[int] = set()
        self._settling = anyio.Lock()
        self._settled_index = 0
        self._death_listeners: list[Callable[[int, str], None]] = []
        self._last_executor: int | None = None
        self._refused = 0
        self._closing = False
        self._tg: anyio.abc.TaskGroup | None = None
        #: The shell request whose ``busy`` is still due (see :meth:`_flush_busy`).
        self._busy_for: _wire.Msg | None = None
        #: The shell request whose ``idle`` is still due (see :meth:`_finish_shell`).
        self._idle_for: _wire.Msg | None = None
        #: Set once a client asked the kernel to shut down (every replica was asked too).
        self.shutdown_requested = anyio.Event()
        #: When the last client request came (the front's start counts as one), and the
        #: event that ends the heartbeat watchers' idle pauses at the next one.
        self._last_request = anyio.current_time()
        self._request_came = anyio.Event()

    def _bind(self, kind: int, port: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{self._ip}:{port}")
        return sock

    # --- public -------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The one session id clients see on every message."""
        return str(self._signer.session.session)

    @property
    def connection_info(self) -> KernelConnectionInfo:
        """What a Jupyter client needs to connect (the content of a connection file)."""
        return {
            "transport": "tcp",
            "ip": self._ip,
            "shell_port": self._ports["shell_port"],
            "iopub_port": self._ports["iopub_port"],
            "stdin_port": self._ports["stdin_port"],
            "control_port": self._ports["control_port"],
            "hb_port": self._ports["hb_port"],
            "key": self._key,
            "signature_scheme": "hmac-sha256",
            "kernel_name": "nbos",
        }

    @property
    def identity(self) -> FrontIdentity:
        """What a later front needs to take this kernel over (``takeover``)."""
        return FrontIdentity(self._key, self.session_id, dict(self._ports))

    @property
    def alive(self) -> tuple[int, ...]:
        """Node ids of the replicas the front believes alive, ascending."""
        return tuple(
            sorted(r for r, up in self._upstreams.items() if up.alive and r not in self._standby)
        )

    @property
    def has_quorum(self) -> bool:
        """Whether a majority of the kernel's replicas is alive (its log can commit)."""
        return len(self.alive) * 2 > len(self._upstreams) - len(self._standby)

    @property
    def refused(self) -> int:
        """How many client messages were refused: unsigned, wrongly signed or malformed
        messages, requests of types the kernel does not serve, bad content."""
        return self._refused

    def _refuse(self) -> None:
        self._refused += 1
        events().message_refused()

    @property
    def last_executor(self) -> int | None:
        """The replica that ran the last cell (``None`` before the first, or once it died)."""
        return self._last_executor

    @property
    def running_on(self) -> int | None:
        """The replica handling the shell request in flight (the executor during a cell)."""
        return self._active.target if self._active is not None else None

    @property
    def last_exec_index(self) -> int:
        """The ``exec_index`` given to the latest cell (0 before the first)."""
        return self._next_index - 1

    @property
    def settled_exec_index(self) -> int:
        """The ``exec_index`` of the latest cell whose reply went to the client (0 before).

        Its ``Done`` has committed; a cell in flight has a later index.
        """
        return self._settled_index

    @property
    def is_closing(self) -> bool:
        """Whether the kernel is being shut down (:meth:`closing` was called)."""
        return self._closing

    def closing(self) -> None:
        """The kernel is being shut down: replicas that end from now on are expected to."""
        self._closing = True

    def on_dead(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(replica, reason)`` whenever the front declares a replica dead.

        Whoever runs the replica's process fences it there: one the front gave up on
        (missed heartbeats) may only be frozen, and must not come back.
        """
        self._death_listeners.append(listener)

    def mark_dead(self, replica: int, reason: str) -> None:
        """Stop using ``replica``; requests in flight there end as lost."""
        up = self._upstreams.get(replica)
        if up is None or not up.mark_dead():
            return
        level = logging.INFO if self._closing else logging.WARNING
        log.log(level, "kernel %s: replica %d is dead (%s)", self._kernel_id, replica, reason)
        quorum = self.has_quorum
        for pending in list(self._pending.values()):
            if pending.target == replica or (pending.needs_quorum and not quorum):
                pending.got_lost()
        for listener in self._death_listeners:
            listener(replica, reason)
        if self._tg is not None and not self._closing:
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
        self._tg.start_soon(self._watch_heartbeat, up)
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
    ) -> _wire.Msg | None:
        """Send a control request of the front's own to ``replica``; its reply or ``None``.

        ``None`` too when the replica is gone (dead, or removed by a replacement), or,
        for a request that ``needs_quorum``, once no majority of replicas is alive.
        """
        up = self._upstreams.get(replica)
        if up is None:
            return None
        msg = up.signer.new_message(msg_type, dict(content))
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
        shell_tx, shell_rx = anyio.create_memory_object_stream[_Incoming](100)
        control_tx, control_rx = anyio.create_memory_object_stream[_Incoming](100)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for up in self._upstreams.values():
                    await tg.start(self._serve_upstream, up)
                await self._wait_ready()
                if self._resume:
                    await self._resume_cells()
                tg.start_soon(self._read_client, self._shell, shell_tx)
                tg.start_soon(self._read_client, self._control, control_tx)
                tg.start_soon(self._read_client_stdin)
                tg.start_soon(self._echo_heartbeats)
                tg.start_soon(self._shell_worker, shell_rx)
                tg.start_soon(self._control_worker, control_rx)
                for up in self._upstreams.values():
                    tg.start_soon(self._watch_heartbeat, up)
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
        self._standby.add(replica)
        await self._tg.start(self._serve_upstream, up)
        if not await self._probe(replica, timeout=timeout):
            self.remove_replica(replica)
            raise KernelError(f"replica {replica} did not answer within {timeout} s")

    def activate_replica(self, replica: int) -> None:
        """Let cells go to ``replica``, added by :meth:`add_replica` (a Raft voter by now)."""
        if replica not in self._standby or self._tg is None:
            return
        self._standby.discard(replica)
        self._tg.start_soon(self._watch_heartbeat, self._upstreams[replica])
        log.info("kernel %s: replica %d joined", self._kernel_id, replica)
        self._settle_soon()

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica`` for good (it was replaced): requests there end as lost."""
        self.mark_dead(replica, "removed from the kernel")
        self._standby.discard(replica)
        scope = self._reader_scopes.pop(replica, None)
        if scope is not None:
            scope.cancel()
        self._upstreams.pop(replica, None)
        if self._last_executor == replica:
            self._last_executor = None

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
        for sock in (self._shell, self._control, self._stdin, self._iopub, self._hb):
            sock.close(0)
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

    async def _resume_cells(self) -> None:
        """Go on after the cells that ran under an earlier front: from the last ``Done`` the
        replicas' log committed, with the replica that claimed the next cell (a cell still
        running there, or its early claim) as the last executor, so the next cell goes
        there if it can. An index it gets wrong costs a lost claim and a retry, no more.
        """
        last_done, claimant = 0, -1
        for replica in self.alive:
            reply = await self.control_request(
                replica, protocol.PROGRESS_REQUEST, {}, timeout=_LOST_TIMEOUT_S
            )
            if reply is None or reply["content"].get("status") != "ok":
                continue
            content = reply["content"]
            if int(content.get(protocol.LAST_DONE, 0)) >= last_done:
                last_done = int(content.get(protocol.LAST_DONE, 0))
                claimant = int(content.get(protocol.NEXT_CLAIMED_BY, -1))
        self._next_index = last_done + 1
        self._settled_index = last_done
        if claimant in self.alive:
            self._last_executor = claimant
        log.info(
            "kernel %s taken over after cell %d (next claimed by %s)",
            self._kernel_id,
            last_done,
            claimant if claimant >= 0 else "none",
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
        self, sock: zmq.asyncio.Socket, tx: MemoryObjectSendStream[_Incoming]
    ) -> None:
        while True:
            frames = await sock.recv_multipart()
            incoming = self._parse_client(frames)
            if incoming is not None:
                self._request_seen()
                await tx.send(incoming)

    def _request_seen(self) -> None:
        self._last_request = anyio.current_time()
        if self._request_came.statistics().tasks_waiting:
            self._request_came.set()
            self._request_came = anyio.Event()

    async def _heartbeat_pause(self, misses: int) -> None:
        """Wait until the next ping: longer while the kernel is idle (see HeartbeatPolicy)."""
        policy = self._heartbeat
        idle = (
            misses == 0
            and policy.idle_interval_s > policy.interval_s
            and not self._pending
            and anyio.current_time() - self._last_request >= policy.idle_interval_s
        )
        if not idle:
            await anyio.sleep(policy.interval_s)
            return
        with anyio.move_on_after(policy.idle_interval_s):
            await self._request_came.wait()

    def _parse_client(self, frames: list[bytes]) -> _Incoming | None:
        try:
            return self._signer.parse(frames)
        except (AuthenticationError, DecodeError) as exc:
            self._refuse()
            log.warning("kernel %s: client message refused: %s", self._kernel_id, exc)
            return None

    async def _screen(
        self, idents: list[bytes], msg: _wire.Msg, channel: _requests.Channel
    ) -> bool:
        """Whether the front serves ``msg``; if not, it is counted, logged and, when it is
        a malformed request, answered with an error reply."""
        try:
            _requests.screen(channel, msg)
        except _requests.UnknownRequestError as exc:
            # Jupyter's rule for a type a kernel does not know: log it and go on.
            self._refuse()
            log.warning("kernel %s: client message ignored: %s", self._kernel_id, exc)
            return False
        except DecodeError as exc:
            self._refuse()
            log.warning("kernel %s: client request refused: %s", self._kernel_id, exc)
            await self._reply_error(idents, msg, channel, exc)
            return False
        return True

    async def _reply_error(
        self, idents: list[bytes], msg: _wire.Msg, channel: _requests.Channel, exc: NbosError
    ) -> None:
        """Answer the request ``msg`` with an error reply (nothing for a message without one)."""
        reply_type = _requests.reply_type(msg["header"]["msg_type"])
        if reply_type is None:
            return
        sock = self._shell if channel == "shell" else self._control
        await self._flush_busy()
        reply = self._signer.new_message(reply_type, protocol.error_content(exc, 0), msg)
        await self._to_client(sock, reply, idents)

    async def _to_client(
        self, sock: zmq.asyncio.Socket, msg: _wire.Msg, idents: Sequence[bytes]
    ) -> None:
        frames = self._signer.frames(msg, idents, session_id=self.session_id)
        await sock.send_multipart(frames, copy=False)

    async def _publish(self, msg: _wire.Msg) -> None:
        await self._flush_busy()
        await self._send_iopub(msg)

    async def _send_iopub(self, msg: _wire.Msg) -> None:
        topic = f"kernel.{self._kernel_id}.{msg['header']['msg_type']}".encode()
        await self._to_client(self._iopub, msg, [topic])

    async def _flush_busy(self) -> None:
        """Publish the shell request's ``busy`` if it is still due.

        It is published once the request went to its replica, so that the request
        does not wait for it, and in any case before anything else the front
        publishes or replies (:meth:`_publish`, :meth:`_reply`): clients still see
        exactly one ``busy``, before any output.
        """
        parent, self._busy_for = self._busy_for, None
        if parent is not None:
            busy = self._signer.new_message("status", {"execution_state": "busy"}, parent)
            await self._send_iopub(busy)

    async def _finish_shell(self) -> None:
        """Publish the shell request's ``idle`` if it is still due.

        That is as soon as its reply was relayed and the replica's own idle came
        (:meth:`_read_iopub`), or else when the request is done with.
        """
        parent, self._idle_for = self._idle_for, None
        if parent is not None:
            await self._publish_status("idle", parent)

    async def _publish_status(self, state: str, parent: _wire.Msg) -> None:
        msg = self._signer.new_message("status", {"execution_state": state}, parent)
        await self._publish(msg)

    async def _reply(
        self, idents: list[bytes], parent: _wire.Msg, msg_type: str, content: dict[str, Any]
    ) -> None:
        await self._flush_busy()
        await self._to_client(
            self._shell, self._signer.new_message(msg_type, content, parent), idents
        )

    async def _echo_heartbeats(self) -> None:
        while True:
            await self._hb.send_multipart(await self._hb.recv_multipart())

    # --- shell ----------------------------------------------------------------------

    async def _shell_worker(self, rx: MemoryObjectReceiveStream[_Incoming]) -> None:
        async for idents, msg in rx:
            stop = await self._handle_shell(idents, msg, abort=False)
            # As ipykernel does: a cell that fails with stop_on_error aborts the
            # execute_requests already queued behind it.
            while stop:
                try:
                    queued = rx.receive_nowait()
                except anyio.WouldBlock:
                    break
                await self._handle_shell(*queued, abort=True)

    async def _handle_shell(self, idents: list[bytes], msg: _wire.Msg, *, abort: bool) -> bool:
        """Handle one shell request; ``True`` if it was a cell whose failure stops the queue."""
        msg_type = msg["header"]["msg_type"]
        self._busy_for = self._idle_for = msg
        try:
            if not await self._screen(idents, msg, "shell"):
                return False
            if msg_type != "execute_request":
                await self._relay(idents, msg, "shell", self._shell)
                return False
            if abort:
                await self._reply(idents, msg, "execute_reply", {"status": "aborted"})
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
        if not self.has_quorum or not await self._settle_unsettled():
            # Without a majority nothing can commit: say so now rather than time out.
            return await self._quorum_lost(idents, msg)
        wait = self._wait_status(msg)
        for _ in range(_CLAIM_ATTEMPTS):
            index = self._next_index
            self._next_index += 1
            try:
                plan = await self._choose(msg, index, wait)
            except NbosError as exc:
                await wait.ended(started=False)
                log.warning("kernel %s: no executor for cell %d: %s", self._kernel_id, index, exc)
                self._next_index = index  # nothing was sent under it: the next cell takes it
                return await self._fail_cell(idents, msg, protocol.error_content(exc, 0))
            await wait.ended(started=True)
            try:
                status = await self._execute_on(idents, msg, index, plan)
            finally:
                await self._chooser.release(plan)
            if status is not None:
                self._settled_index = index
                return status
            # Another replica holds the index's claim (it claimed early and was not
            # chosen after all): retire the index and send the cell again under a new one.
            if await self._settle(index) is None:
                return await self._quorum_lost(idents, msg)
        failure = KernelError(f"no replica could claim the cell in {_CLAIM_ATTEMPTS} attempts")
        return await self._fail_cell(idents, msg, protocol.error_content(failure, 0))

    async def _quorum_lost(self, idents: list[bytes], msg: _wire.Msg) -> str:
        """Reply ``QuorumLostError`` to a cell that cannot run: no majority, or an earlier
        index still unsettled."""
        lost = QuorumLostError(
            f"only replicas {list(self.alive)} of {sorted(self._upstreams)} are alive"
            if not self.has_quorum
            else f"cells {sorted(self._unsettled)} could not be settled: no majority answered"
        )
        log.warning("kernel %s: %s", self._kernel_id, lost)
        return await self._fail_cell(idents, msg, protocol.error_content(lost, 0))

    async def _fail_cell(self, idents: list[bytes], msg: _wire.Msg, content: dict[str, Any]) -> str:
        """Answer a cell with the error reply ``content``; returns its status, ``"error"``.

        The error goes out as the cell's ``error`` output too, as a replica's would: a
        notebook shows a cell's outputs, not its reply.
        """
        error = {k: content[k] for k in ("ename", "evalue", "traceback")}
        await self._publish(self._signer.new_message("error", error, msg))
        await self._reply(idents, msg, "execute_reply", content)
        return "error"

    async def _choose(self, msg: _wire.Msg, index: int, wait: WaitStatus) -> CellPlan:
        """The chooser's plan for cell ``index``; an interrupt ends a wait (for GPUs)."""
        with anyio.CancelScope() as scope:
            self._choosing = scope
            try:
                return await self._chooser.choose(self._choice_request(msg, index, wait))
            finally:
                self._choosing = None
        raise KernelError(f"cell {index} was interrupted while it waited to run")

    def _wait_status(self, msg: _wire.Msg) -> WaitStatus:
        """The status output of cell ``msg`` while it waits to run, updated in place."""

        async def publish(msg_type: str, content: dict[str, Any]) -> None:
            await self._publish(self._signer.new_message(msg_type, content, msg))

        return WaitStatus(publish, f"nbos-wait-{msg['header']['msg_id']}")

    def _choice_request(self, msg: _wire.Msg, index: int, wait: WaitStatus) -> ChoiceRequest:
        code = msg["content"].get("code", "")
        return ChoiceRequest(
            index,
            self._last_executor,
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
            self._last_executor = plan.replica
            await self._to_client(self._shell, reply, idents)
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
            needs_quorum=True,
        )
        if pending.reply is None:
            return await self._cell_lost(idents, msg, index, plan.replica)
        if protocol.claim_lost(pending.reply["metadata"]):
            return None
        return str(pending.reply["content"].get("status", "error"))

    async def _settle(self, index: int) -> dict[str, Any] | None:
        """Have a live replica commit ``Done(index, lost)``; what it says counts for the cell.

        ``None`` (at once when no majority is alive) if none could: the index is then
        kept and settled again once a majority is back (:meth:`_settle_unsettled`).
        """
        for survivor in self.alive:
            if not self.has_quorum:
                break
            reply = await self.control_request(
                survivor,
                protocol.LOST_REQUEST,
                {protocol.LOST_INDEX: index},
                timeout=_LOST_TIMEOUT_S,
                needs_quorum=True,
            )
            if reply is not None and reply["content"].get("status") == "ok":
                self._unsettled.discard(index)
                settled: dict[str, Any] = reply["content"]
                return settled
        self._unsettled.add(index)
        log.warning("kernel %s: cell %d is not settled yet", self._kernel_id, index)
        return None

    async def _settle_unsettled(self) -> bool:
        """Settle the indices whose settle found no majority, in order; whether all are."""
        async with self._settling:
            for index in sorted(self._unsettled):
                settled = await self._settle(index)
                if settled is None:
                    return False
                log.info(
                    "kernel %s: cell %d settled as %s",
                    self._kernel_id,
                    index,
                    settled.get(protocol.CELL_STATUS),
                )
            return True

    def _settle_soon(self) -> None:
        """A replica is back: settle what waits for a majority now, not at the next cell."""
        if self._unsettled and self.has_quorum and self._tg is not None:
            self._tg.start_soon(self._settle_in_background)

    async def _settle_in_background(self) -> None:
        try:
            await self._settle_unsettled()
        except (NbosError, zmq.ZMQError):
            # The next cell tries again; the front must not go down with this.
            log.exception("kernel %s: settling cells failed", self._kernel_id)

    async def _cell_lost(
        self, idents: list[bytes], msg: _wire.Msg, index: int, executor: int
    ) -> str:
        """The executor died before replying: have a survivor settle the cell, tell the client."""
        self._last_executor = None
        settled = await self._settle(index)
        if settled is None:
            exc: NbosError = QuorumLostError(
                f"cell {index} stopped with its kernel's majority of replicas: it is settled "
                "(committed or lost) once a majority is back"
            )
            content = protocol.error_content(exc, 0)
        elif settled.get(protocol.CELL_STATUS) == "lost":
            content = protocol.error_content(
                CellLostError(index, executor), int(settled.get(protocol.EXECUTION_COUNT, 0))
            )
        else:
            # The executor committed the cell and died before its reply reached us.
            content = {
                "status": settled.get(protocol.CELL_STATUS, "ok"),
                "execution_count": int(settled.get(protocol.EXECUTION_COUNT, 1)) - 1,
                "user_expressions": {},
                "payload": [],
            }
            if content["status"] == "error":
                content.update(protocol.error_content(KernelError(f"cell {index} failed"), 0))
        log.warning("kernel %s: cell %d settled as %s", self._kernel_id, index, content["status"])
        if content["status"] == "error":
            return await self._fail_cell(idents, msg, content)
        await self._reply(idents, msg, "execute_reply", content)
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
            if reply["header"]["msg_type"] == "kernel_info_reply":
                reply = _without_subshells(reply)
            await self._to_client(sock, reply, idents)
            return True

        expects_reply = msg["header"]["msg_type"].endswith("_request")
        preferred = [self._last_executor] if self._last_executor in self.alive else []
        for target in [*preferred, *self.alive]:
            assert target is not None
            pending = await self._roundtrip(
                target, channel, msg, idents, grace=IDLE_GRACE_S, on_reply=relay
            )
            if pending.reply is not None or not expects_reply:
                return  # a comm message may have reached the log; never send it twice
            if not pending.lost:
                self._refuse()
                failure = KernelError(f"replica {target} sent no reply to {msg['msg_type']}")
                log.warning("kernel %s: %s", self._kernel_id, failure)
                await self._reply_error(idents, msg, channel, failure)
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
        needs_quorum: bool = False,
        client: bool = True,
    ) -> _Pending:
        """Send ``msg`` to ``target``; wait for its reply (``on_reply`` gets it at once and
        says whether it answered the client), then for its idle (at most ``grace`` seconds
        longer). A request that ``needs_quorum`` ends as lost once no majority is alive; a
        shell ``msg`` of a ``client`` is the request in flight meanwhile."""
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
            if shell:
                await self._flush_busy()
            await _wait_reply(pending)
            if pending.reply is not None and on_reply is not None:
                # The client may have it before the replica's last output: as with any
                # kernel, a client waits for idle to know a request is complete.
                pending.answered = await on_reply(pending.reply)
            # The replica's idle follows everything it published for the request; past
            # the grace we go on without it (an IOPub message can be lost).
            with anyio.move_on_after(grace):
                await pending.idled.wait()
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

    async def _control_worker(self, rx: MemoryObjectReceiveStream[_Incoming]) -> None:
        async for idents, msg in rx:
            msg_type = msg["header"]["msg_type"]
            await self._publish_status("busy", msg)
            try:
                if await self._screen(idents, msg, "control"):
                    await self._serve_control(idents, msg)
            except (NbosError, zmq.ZMQError, KeyError, TypeError, ValueError):
                log.exception("kernel %s: %s failed", self._kernel_id, msg_type)
            finally:
                await self._publish_status("idle", msg)

    async def _serve_control(self, idents: list[bytes], msg: _wire.Msg) -> None:
        msg_type = msg["header"]["msg_type"]
        if msg_type == "shutdown_request":
            await self._shutdown(idents, msg)
        elif msg_type == "interrupt_request":
            await self._interrupt(idents, msg)
        else:
            await self._relay(idents, msg, "control", self._control)

    async def _interrupt(self, idents: list[bytes], msg: _wire.Msg) -> None:
        if self._choosing is not None:
            # The cell waits for its executor (GPUs): it has not started anywhere yet.
            self._choosing.cancel()
            reply = self._signer.new_message("interrupt_reply", {"status": "ok"}, msg)
            await self._to_client(self._control, reply, idents)
            return
        active = self._active
        target = active.target if active is not None else self._last_executor
        if target is None or target not in self.alive:
            target = self.alive[0] if self.alive else None
        if target is None:
            return
        pending = await self._roundtrip(target, "control", msg, idents, grace=IDLE_GRACE_S)
        content = {"status": "ok"} if pending.reply is None else pending.reply["content"]
        reply = self._signer.new_message("interrupt_reply", content, msg)
        await self._to_client(self._control, reply, idents)

    async def _shutdown(self, idents: list[bytes], msg: _wire.Msg) -> None:
        self.closing()
        restart = bool(msg["content"].get("restart", False))
        with anyio.move_on_after(_SHUTDOWN_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for replica in self.alive:
                    tg.start_soon(self._shutdown_one, replica)
        content = {"status": "ok", "restart": restart}
        reply = self._signer.new_message("shutdown_reply", content, msg)
        await self._to_client(self._control, reply, idents)
        await self._publish(self._signer.new_message("shutdown_reply", content, msg))
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
            frames = await up.iopub.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            if parsed is None:
                continue
            msg = parsed[1]
            parent_id = msg["parent_header"].get("msg_id", "")
            is_status = msg["header"]["msg_type"] == "status"
            pending = self._pending.get(parent_id)
            if pending is not None and pending.target == up.replica:
                if not is_status:
                    await self._publish(msg)
                elif msg["content"].get("execution_state") == "idle":
                    pending.got_idle()
                    if pending.answered and pending is self._active:
                        # Everything is out: the client need not wait for the request's
                        # task to wake up and unwind.
                        await self._finish_shell()
            elif not is_status and self._finished.get(parent_id) == up.replica:
                # Late output of a finished request (a thread the cell started), from the
                # replica that ran it: a client shows it with that cell, as with ipykernel.
                await self._publish(msg)

    async def _read_input_requests(self, up: Upstream) -> None:
        sock = up.sockets["stdin"]
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            active = self._active
            if parsed is None or active is None or active.target != up.replica:
                continue
            await self._to_client(self._stdin, parsed[1], active.idents)

    async def _read_client_stdin(self) -> None:
        while True:
            incoming = self._parse_client(await self._stdin.recv_multipart())
            active = self._active
            if incoming is None:
                continue
            if active is None or not self._upstreams[active.target].alive:
                log.warning("kernel %s: input_reply with no cell waiting", self._kernel_id)
                continue
            await self._upstreams[active.target].send("stdin", incoming[1])

    def _parse_upstream(self, up: Upstream, frames: list[bytes]) -> _Incoming | None:
        try:
            return up.signer.parse(frames)
        except (AuthenticationError, DecodeError) as exc:
            log.warning(
                "kernel %s: replica %d sent a bad message: %s", self._kernel_id, up.replica, exc
            )
            return None

    async def _watch_heartbeat(self, up: Upstream) -> None:
        """Ping ``up`` until it is marked dead (a revival starts a new watcher).

        The watcher's REQ socket is its own, closed by nobody else: a receive pending on
        a zmq.asyncio socket that is closed ends in a bare ``CancelledError``, which
        would cancel every task of the front.
        """
        policy = self._heartbeat
        life = up.life

        def current() -> bool:
            return up.alive and up.life == life

        misses = 0
        sock = up.new_heartbeat()
        try:
            while current():
                await self._heartbeat_pause(misses)
                if not current():
                    return
                if await self._ping(up.replica, sock, policy.timeout_s):
                    misses = 0
                    continue
                # A REQ socket that got no answer is stuck mid-exchange: start a fresh one.
                sock.close(0)
                sock = up.new_heartbeat()
                misses += 1
                # A watcher of an earlier life never counts against a revived replica.
                if misses >= policy.misses and current():
                    self.mark_dead(up.replica, f"{misses} heartbeats missed")
        finally:
            sock.close(0)

    async def _ping(self, replica: int, sock: zmq.asyncio.Socket, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            try:
                await sock.send(b"ping")
                await sock.recv()
            except zmq.ZMQError as exc:
                log.debug("heartbeat of replica %d: %s", replica, exc)
            else:
                return True
        return False


async def _wait_reply(pending: _Pending) -> None:
    """Until ``pending`` has its reply, or its replica went idle without sending one."""
    async with anyio.create_task_group() as tg:

        async def idle_without_reply() -> None:
            await pending.idled.wait()
            await anyio.sleep(NO_REPLY_GRACE_S)
            tg.cancel_scope.cancel()

        tg.start_soon(idle_without_reply)
        await pending.replied.wait()
        tg.cancel_scope.cancel()


def _without_subshells(reply: _wire.Msg) -> _wire.Msg:
    """``reply`` (a replica's ``kernel_info_reply``) without the subshell feature: the
    front serves one shell request at a time and refuses subshell requests."""
    features = reply["content"].get("supported_features")
    if not isinstance(features, list) or "kernel subshells" not in features:
        return reply
    kept = [f for f in features if f != "kernel subshells"]
    return {**reply, "content": {**reply["content"], "supported_features": kept}}


def _bound_port(sock: zmq.asyncio.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.decode().rsplit(":", 1)[1])
