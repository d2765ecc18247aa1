"""The front's Jupyter server side: the five sockets clients connect to, and what they
read there.

Clients know a kernel by its key, session id and ports (:class:`FrontIdentity`); a
front that takes a kernel over binds the same ports with the same key and session, so
that its clients go on. Every message to clients carries that session id.

A client message that is unsigned, wrongly signed or malformed is refused with a log
line; a signed request of a type the kernel does not serve is logged and ignored, and
one with bad content gets an error reply (:mod:`._requests`). Each is counted
(:attr:`ClientChannels.refused`).

A shell request shows on IOPub as exactly one ``busy`` before anything else of it:
that ``busy`` is published once the request went to its replica (so the request does
not wait for it), and in any case before anything else the front publishes or replies
(:meth:`ClientChannels.flush_busy`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import zmq
import zmq.asyncio

from nbos.core.errors import AuthenticationError, DecodeError, NbosError, TransportError
from nbos.kernel import protocol
from nbos.kernel.front import _requests, _wire
from nbos.metrics import events
from nbos.transport.ports import bind_port

log = logging.getLogger(__name__)

Incoming = tuple[list[bytes], _wire.Msg]

#: The sockets, by the name of their port.
_SOCKETS = {
    "shell_port": zmq.ROUTER,
    "iopub_port": zmq.PUB,
    "stdin_port": zmq.ROUTER,
    "control_port": zmq.ROUTER,
    "hb_port": zmq.ROUTER,
}


@attrs.frozen
class FrontIdentity:
    """What clients know a front by: its key, session id and ports (``shell_port`` ...).

    ``session`` ``None``: a new one (a restarted kernel is a new session).
    """

    key: str
    session: str | None
    ports: Mapping[str, int]


def _bind(sock: zmq.asyncio.Socket, ip: str, port: int | None) -> None:
    """Bind ``sock`` on ``port``, or on a fresh one below the ephemeral range: a front
    taken over by a restarted gateway binds its ports again, and one in that range may
    have become some connection's source port meanwhile (a kernel was lost so in CI)."""

    def bind(number: int) -> int:
        sock.bind(f"tcp://{ip}:{number}")
        return _bound_port(sock)

    bind_port(bind, ip, port or 0, keep=port is not None)


class ClientChannels:
    """The five sockets of kernel ``kernel_id``'s front, bound on ``ip`` in ``ctx``: the
    ports, key and session of ``identity``, or fresh ones. Ports that cannot be bound
    raise :class:`~nbos.core.errors.TransportError`."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        kernel_id: str,
        ip: str,
        identity: FrontIdentity | None,
    ) -> None:
        self._kernel_id = kernel_id
        #: When each ``execute_request`` not yet handled arrived (``time.time()``), by msg id.
        self.arrived: dict[str, float] = {}
        self.key = identity.key if identity is not None else secrets.token_hex(32)
        self._signer = _wire.Signer(
            {"key": self.key},
            username="nbos",
            session_id=identity.session if identity is not None else None,
        )
        ports = identity.ports if identity is not None else {}
        bound: list[zmq.asyncio.Socket] = []
        try:
            for name, kind in _SOCKETS.items():
                sock = ctx.socket(kind)
                bound.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                _bind(sock, ip, ports.get(name))
        except zmq.ZMQError as exc:
            for sock in bound:
                sock.close(0)
            raise TransportError(f"kernel {kernel_id}: cannot bind its front: {exc}") from exc
        sockets = dict(zip(_SOCKETS, bound, strict=True))
        self.shell, self.iopub = sockets["shell_port"], sockets["iopub_port"]
        self.stdin, self.control = sockets["stdin_port"], sockets["control_port"]
        self.hb = sockets["hb_port"]
        # Kept apart from the sockets: the gateway records a kernel's ports (its state file)
        # even while the kernel stops and its sockets are closed.
        self.ports = {name: _bound_port(sock) for name, sock in sockets.items()}
        self._refused = 0
        #: The shell request whose ``busy`` is still due (see :meth:`flush_busy`).
        self._busy_for: _wire.Msg | None = None

    @property
    def session_id(self) -> str:
        """The one session id clients see on every message."""
        return str(self._signer.session.session)

    @property
    def identity(self) -> FrontIdentity:
        return FrontIdentity(self.key, self.session_id, dict(self.ports))

    @property
    def refused(self) -> int:
        """How many client messages were refused: unsigned, wrongly signed or malformed
        messages, requests of types the kernel does not serve, bad content."""
        return self._refused

    def refuse(self) -> None:
        self._refused += 1
        events().message_refused()

    def close(self) -> None:
        for sock in (self.shell, self.control, self.stdin, self.iopub, self.hb):
            sock.close(0)

    # --- from clients ---------------------------------------------------------------

    def parse(self, frames: list[bytes]) -> Incoming | None:
        """A client's message, or ``None`` if it is refused."""
        try:
            incoming = self._signer.parse(frames)
        except (AuthenticationError, DecodeError) as exc:
            self.refuse()
            log.warning("kernel %s: client message refused: %s", self._kernel_id, exc)
            return None
        header = incoming[1].get("header")
        if isinstance(header, dict) and header.get("msg_type") == "execute_request":
            self.arrived[str(header.get("msg_id", ""))] = time.time()
        return incoming

    async def screen(self, idents: list[bytes], msg: _wire.Msg, channel: _requests.Channel) -> bool:
        """Whether the front serves ``msg``; if not, it is counted, logged and, when it is
        a malformed request, answered with an error reply."""
        try:
            _requests.screen(channel, msg)
        except _requests.UnknownRequestError as exc:
            # Jupyter's rule for a type a kernel does not know: log it and go on.
            self.refuse()
            log.warning("kernel %s: client message ignored: %s", self._kernel_id, exc)
            return False
        except DecodeError as exc:
            self.refuse()
            log.warning("kernel %s: client request refused: %s", self._kernel_id, exc)
            await self.reply_error(idents, msg, channel, exc)
            return False
        return True

    async def echo_heartbeats(self) -> None:
        while True:
            await self.hb.send_multipart(await self.hb.recv_multipart())

    # --- to clients -----------------------------------------------------------------

    def new_message(
        self, msg_type: str, content: dict[str, Any], parent: _wire.Msg | None = None
    ) -> _wire.Msg:
        """A fresh message of the front's session."""
        return self._signer.new_message(msg_type, content, parent)

    async def send(self, sock: zmq.asyncio.Socket, msg: _wire.Msg, idents: Sequence[bytes]) -> None:
        """``msg`` to the client of ``idents`` on ``sock``, signed, in the front's session."""
        frames = self._signer.frames(msg, idents, session_id=self.session_id)
        await sock.send_multipart(frames, copy=False)

    async def reply(
        self, idents: list[bytes], parent: _wire.Msg, msg_type: str, content: dict[str, Any]
    ) -> None:
        """A fresh shell reply to ``parent``."""
        await self.flush_busy()
        await self.send(self.shell, self.new_message(msg_type, content, parent), idents)

    async def reply_error(
        self, idents: list[bytes], msg: _wire.Msg, channel: _requests.Channel, exc: NbosError
    ) -> None:
        """Answer the request ``msg`` with an error reply (nothing for a message without one)."""
        reply_type = _requests.reply_type(msg["header"]["msg_type"])
        if reply_type is None:
            return
        sock = self.shell if channel == "shell" else self.control
        await self.flush_busy()
        reply = self.new_message(reply_type, protocol.error_content(exc, 0), msg)
        await self.send(sock, reply, idents)

    async def publish(self, msg: _wire.Msg) -> None:
        """``msg`` on IOPub, after the shell request's ``busy`` if that is still due."""
        await self.flush_busy()
        await self._send_iopub(msg)

    async def publish_status(self, state: str, parent: _wire.Msg) -> None:
        await self.publish(self.new_message("status", {"execution_state": state}, parent))

    def busy_due(self, parent: _wire.Msg) -> None:
        """Shell request ``parent`` began: its ``busy`` goes out at :meth:`flush_busy`."""
        self._busy_for = parent

    async def flush_busy(self) -> None:
        """Publish the shell request's ``busy`` if it is still due (see the module doc)."""
        parent, self._busy_for = self._busy_for, None
        if parent is not None:
            await self._send_iopub(self.new_message("status", {"execution_state": "busy"}, parent))

    async def _send_iopub(self, msg: _wire.Msg) -> None:
        topic = f"kernel.{self._kernel_id}.{msg['header']['msg_type']}".encode()
        await self.send(self.iopub, msg, [topic])


def _bound_port(sock: zmq.asyncio.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.decode().rsplit(":", 1)[1])
