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

The front composes the parts that do this: the sockets clients connect to
(:mod:`._clients`: signing, refusals, one ``busy`` per request), the shell channel
(:mod:`._shell`: requests one at a time, the execute path) and its one ``idle`` per
request (:mod:`._shell_idle`), the control channel (:mod:`._control`: interrupts,
shutdown), the relay of requests and replies (:mod:`._relay`), the cell protocol
(:mod:`._cells`: exec indices, claims, settles), the replicas the front reaches
(:mod:`._membership`: start, revival, replacement) and their liveness
(:mod:`._liveness`: heartbeats, deaths, the majority); all speak to replicas in the
terms of :mod:`nbos.kernel.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import anyio
import anyio.abc
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectSendStream
from jupyter_client.connect import KernelConnectionInfo

from nbos.core.errors import KernelError, QuorumLostError, TransportError
from nbos.core.executor_chooser import ExecutorChooser
from nbos.kernel.front._cells import Cells
from nbos.kernel.front._chooser import LastExecutorChooser
from nbos.kernel.front._clients import ClientChannels, FrontIdentity, Incoming
from nbos.kernel.front._control_channel import ControlWorker
from nbos.kernel.front._liveness import HeartbeatPolicy, Liveness
from nbos.kernel.front._membership import READY_TIMEOUT_S, Membership
from nbos.kernel.front._relay import Relay
from nbos.kernel.front._shell import ShellWorker
from nbos.kernel.front._shell_idle import ShellIdle
from nbos.kernel.front._upstream import ReplicaEndpoint, Upstream

#: A kernel's cell in progress: none, one that waits to start (for GPUs, for a
#: migration), or one that runs.
CellActivity = Literal["none", "waiting", "running"]


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
        upstreams = {r.replica: Upstream(r, self._ctx) for r in replicas}
        self._liveness = Liveness(
            kernel_id, upstreams, heartbeat or HeartbeatPolicy(), lambda: self._relay.busy
        )
        self._idle = ShellIdle(self._clients)
        #: What a request is told that the kernel cannot serve for want of a majority of
        #: live replicas, given the front's account of them (``only replicas [2] of [1, 2,
        #: 3] are alive``): whoever runs the kernel knows whether it is dead or recovering.
        self.unavailable: Callable[[str], QuorumLostError] = QuorumLostError
        self._relay = Relay(
            kernel_id,
            upstreams,
            self._clients,
            self._liveness,
            self._idle,
            refusal=self._refusal,
        )
        #: Send a control request of the front's own to a replica; its reply or ``None``
        #: (:meth:`Relay.control_request <nbos.kernel.front._relay.Relay.control_request>`).
        self.control_request = self._relay.control_request
        self._cells = Cells(
            kernel_id,
            self._liveness,
            self._relay.control_request,
            self._unavailable,
        )
        self._shell: ShellWorker | None = None
        self._membership = Membership(
            kernel_id,
            ctx=self._ctx,
            upstreams=upstreams,
            liveness=self._liveness,
            relay=self._relay,
            cells=self._cells,
        )
        # First of the death listeners: requests in flight end before anyone hears of it.
        self._liveness.on_dead(self._membership.replica_died)
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
    def voters(self) -> tuple[int, ...]:
        """Node ids of the replicas a majority is counted of (a replacement still being
        added aside), dead ones too, ascending."""
        return self._liveness.voters

    @property
    def has_quorum(self) -> bool:
        """Whether a majority of the kernel's replicas is alive (its log can commit)."""
        return self._liveness.has_quorum

    @property
    def started(self) -> bool:
        """Whether the front serves clients: it heard every replica of its start, and
        has not ended."""
        return self._shell is not None

    @property
    def cell(self) -> CellActivity:
        """The cell in progress: none, one that waits to start, or one that runs."""
        cell = self._shell.cell if self._shell is not None else None
        if cell is None:
            return "none"
        return "waiting" if cell.waiting else "running"

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
        active = self._relay.active
        return active.target if active is not None else None

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

        One that missed heartbeats is only suspected (:meth:`unresponsive`): it may be
        slow or frozen, and is used again if it answers before it is replaced.
        """
        self._liveness.on_dead(listener)

    def unresponsive(self, replica: int) -> bool:
        """Whether ``replica`` is left out on suspicion alone (missed heartbeats)."""
        return self._liveness.unresponsive(replica)

    def suspect(self, replica: int, reason: str) -> None:
        """Leave ``replica`` out on suspicion: it is used again once it answers."""
        self._membership.suspect(replica, reason)

    def mark_dead(self, replica: int, reason: str) -> None:
        """``replica``'s process ended (proof, never suspicion: see :meth:`suspect`): stop
        using it; requests in flight there end as lost, and if it led the kernel's Raft
        group a survivor campaigns at once rather than after an election timeout."""
        # The campaign's request first: a settle of a cell lost with the replica waits
        # for a leader, and a replica serves its control requests one at a time.
        self._membership.process_ended(replica)
        self._liveness.mark_dead(replica, reason)

    async def revive(self, replica: int, *, timeout: float = READY_TIMEOUT_S) -> None:
        """Use ``replica`` again once it answers: it was restarted after :meth:`mark_dead`.

        Raises :class:`KernelError` if it does not answer within ``timeout``.
        """
        await self._membership.revive(replica, timeout=timeout)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve clients until cancelled; ``task_status.started()`` once every replica answered."""
        shell_tx, shell_rx = anyio.create_memory_object_stream[Incoming](100)
        control_tx, control_rx = anyio.create_memory_object_stream[Incoming](100)
        try:
            async with anyio.create_task_group() as tg:
                await self._membership.start(tg)
                if self._resume:
                    await self._cells.resume()
                shell = ShellWorker(
                    self._kernel_id,
                    clients=self._clients,
                    relay=self._relay,
                    idle=self._idle,
                    cells=self._cells,
                    liveness=self._liveness,
                    chooser=self._chooser,
                    tg=tg,
                )
                control = ControlWorker(
                    self._kernel_id,
                    clients=self._clients,
                    relay=self._relay,
                    cells=self._cells,
                    liveness=self._liveness,
                    shell=shell,
                    shutdown_requested=self.shutdown_requested,
                )
                tg.start_soon(self._read_client, self._clients.shell, shell_tx)
                tg.start_soon(self._read_client, self._clients.control, control_tx)
                tg.start_soon(self._relay.read_client_stdin)
                tg.start_soon(self._clients.echo_heartbeats)
                tg.start_soon(shell.serve, shell_rx)
                tg.start_soon(control.serve, control_rx)
                self._membership.watch(tg)
                self._shell = shell
                task_status.started()
        finally:
            self._shell = None
            self.close()

    async def add_replica(
        self, endpoint: ReplicaEndpoint, *, timeout: float = READY_TIMEOUT_S
    ) -> None:
        """Start using a new replica (a replacement) once it answers.

        Until :meth:`activate_replica` it is reachable by :meth:`control_request` but
        not :attr:`alive`: no cell goes to it. Raises :class:`KernelError` if it does
        not answer within ``timeout`` (it is removed again then).
        """
        await self._membership.add(endpoint, timeout=timeout)

    def activate_replica(self, replica: int) -> None:
        """Let cells go to ``replica``, added by :meth:`add_replica` (a Raft voter by now)."""
        self._membership.activate(replica)

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica`` for good (it was replaced): requests there end as lost."""
        self._membership.remove(replica)

    # Looked up at each call: the cells are made after the relay, and whoever runs the
    # kernel sets ``unavailable`` after the front is made.
    def _refusal(self) -> QuorumLostError:
        return self._cells.refusal()

    def _unavailable(self, account: str) -> QuorumLostError:
        return self.unavailable(account)

    def close(self) -> None:
        """Close the front's sockets; :meth:`serve` does on its way out, and whoever made
        a front it never served must (once more is harmless).

        A front left to the garbage collector would hang the process that collects it:
        its sockets' weak references are cleared before the context's finalizer runs,
        which then waits for them forever.
        """
        if self._ctx.closed:
            return
        self._membership.close()
        self._clients.close()
        # Any socket a request opened and its cancellation left open is closed too.
        self._ctx.destroy(linger=0)

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
