"""The front's connection to one replica: client sockets on the replica's five channels."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import anyio
import attrs
import zmq
import zmq.asyncio

from nbos.core.errors import KernelError
from nbos.kernel.front import _wire
from nbos.kernel.jupyter_requests import connect, curve_of

log = logging.getLogger(__name__)

Channel = Literal["shell", "control", "stdin"]

#: Messages of a replica's IOPub that the front's socket holds unread (ZeroMQ's default:
#: 1,000). A stream message is at most 1 Mi characters (the replica's
#: ``STREAM_MESSAGE_CHARS``), so a flood the front is behind on holds at most about this
#: many MiB of the gateway's memory here; the rest waits in the replica's own queue
#: (which, past its high-water mark, drops, as any kernel's IOPub does).
IOPUB_QUEUE_MESSAGES = 16


@attrs.frozen
class ReplicaEndpoint:
    """One replica as the front sees it: its node id and its Jupyter connection info."""

    replica: int
    connection: Mapping[str, Any]


class Upstream:
    """Sockets to one replica, signed with that replica's own key, and CURVE clients of
    its kernel's key pair where its connection info has one.

    The shell and stdin sockets share one identity: ipykernel sends ``input_request``
    to the identity the ``execute_request`` came from.
    """

    def __init__(self, endpoint: ReplicaEndpoint, ctx: zmq.asyncio.Context) -> None:
        self.replica = endpoint.replica
        self.signer = _wire.Signer(endpoint.connection, username="nbos-front")
        self.alive = True
        #: Counts revivals, so a watcher of an earlier life knows to stop.
        self.life = 0
        self._ctx = ctx
        self._connection = dict(endpoint.connection)
        self._curve = curve_of(self._connection)
        identity = f"nbos-front-{uuid.uuid4().hex}".encode()
        self.sockets: dict[Channel, zmq.asyncio.Socket] = {
            "shell": self._connect(zmq.DEALER, "shell", identity),
            "control": self._connect(zmq.DEALER, "control"),
            "stdin": self._connect(zmq.DEALER, "stdin", identity),
        }
        self.iopub = self._connect(zmq.SUB, "iopub", hwm=IOPUB_QUEUE_MESSAGES)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        # The same socket without pyzmq's asyncio layer (see receive_iopub).
        self._iopub_direct: zmq.Socket[bytes] = zmq.Socket.shadow(self.iopub.underlying)

    def _connect(
        self, kind: int, channel: str, identity: bytes | None = None, *, hwm: int | None = None
    ) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            sock.setsockopt(zmq.RCVHWM, hwm)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        connect(sock, self._connection, channel, self._curve)
        return sock

    def new_heartbeat(self) -> zmq.asyncio.Socket:
        """A fresh REQ socket to the replica's heartbeat (a REQ that timed out is stuck).

        Its heartbeat watcher owns it and closes it.
        """
        return self._connect(zmq.REQ, "hb")

    async def send(self, channel: Channel, msg: _wire.Msg) -> None:
        """Re-sign ``msg`` with this replica's key and send it on ``channel``.

        Raises :class:`KernelError` once the upstream is closed (its replica was
        removed while a request to it was on its way).
        """
        sock = self.sockets[channel]
        if sock.closed:
            raise KernelError(f"replica {self.replica} was removed from the kernel")
        await sock.send_multipart(self.signer.frames(msg), copy=False)

    async def receive_iopub(self) -> list[bytes]:
        """The next message the replica published.

        Not pyzmq's asyncio ``recv_multipart``, which sets up a future and its poller
        state for each message, three or more per cell. A SUB socket only receives, so
        nothing else here takes its descriptor's edge: reading until the socket is empty
        before waiting on the descriptor misses nothing.
        """
        sock = self._iopub_direct
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.wait_readable(sock.FD)

    def mark_dead(self) -> bool:
        """Record the replica as dead; ``True`` the first time."""
        if not self.alive:
            return False
        self.alive = False
        return True

    def revive(self) -> None:
        """The replica runs again (restarted on the same ports); ZeroMQ reconnects on its own."""
        self.alive = True
        self.life += 1

    def close(self) -> None:
        for sock in (*self.sockets.values(), self.iopub):
            sock.close(0)
