"""The gateway's join endpoint: agents with a join token get their own key pinned here.

A ROUTER of its own, a CURVE server with the gateway's key pair that admits any client
key (the joining agent's is new; no ZAP handler runs in its context), and that takes
only :class:`~nbos.core.wire.agent.AgentJoin`. The agent endpoint itself admits pinned
keys only, so a client never reaches it before its join was checked here. Every answer
is one message (``AgentJoined`` or ``JoinRefused``) and every refusal a log line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
import zmq
import zmq.asyncio

from nbos.core.errors import ConfigError, DecodeError, TransportError
from nbos.core.wire import AnyMessage, decode, encode
from nbos.core.wire.agent import AgentJoin, AgentJoined, JoinRefusalKind, JoinRefused
from nbos.transport import ZmqTransport
from nbos.transport.join import JoinToken, JoinVerifier, pin_host_key
from nbos.transport.keys import KeyDirectory, check_host_name
from nbos.transport.zmq import CurveKeys, curve_server

log = logging.getLogger(__name__)

# A join is a few hundred bytes; anything much larger is not one.
_MAX_JOIN_BYTES = 4096


def gateway_join_token(keys: KeyDirectory, path: str) -> JoinToken:
    """The token in ``path``, refused (:class:`ConfigError`) unless it names this gateway's key."""
    token = JoinToken.read(path)
    if token.gateway_public != keys.gateway_public():
        raise ConfigError(
            "gateway.join_token_file", path, f"a token of this gateway's key ({keys.path})"
        )
    return token


@attrs.frozen
class JoinSettings:
    """Where the gateway serves joins, with which keys and token (checked)."""

    address: str
    keys: KeyDirectory
    token: JoinToken

    def serve(self, agents: ZmqTransport) -> AbstractAsyncContextManager[JoinEndpoint]:
        """The join endpoint, admitting each key it pins to ``agents`` (the agent endpoint)."""
        curve = self.keys.gateway_curve()
        return JoinEndpoint.serve(self.address, self.keys, curve, self.token, agents.admit_client)


class JoinEndpoint:
    """Serves joins at one address; build it with :meth:`serve`."""

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        keys: Path,
        token: JoinToken,
        admit: Callable[[bytes], None],
    ) -> None:
        self._socket = socket
        self._keys = keys
        self._verifier = JoinVerifier(token)
        self._admit = admit
        self.address = bytes(socket.getsockopt(zmq.LAST_ENDPOINT)).decode()

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        address: str,
        keys: KeyDirectory,
        curve: CurveKeys,
        token: JoinToken,
        admit: Callable[[bytes], None],
    ) -> AsyncIterator[JoinEndpoint]:
        """Serve joins at ``address`` until the block exits; ``admit`` is called with each
        key pinned (the agent endpoint's keyring)."""
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, _MAX_JOIN_BYTES)
        curve_server(socket, curve)
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            context.destroy(linger=0)
            raise TransportError(f"cannot bind the join endpoint {address!r}: {exc}") from exc
        endpoint = cls(socket, keys.path, token, admit)
        log.info("join endpoint at %s", endpoint.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(endpoint._serve)
                try:
                    yield endpoint
                finally:
                    tg.cancel_scope.cancel()
        finally:
            context.destroy(linger=0)

    async def _serve(self) -> None:
        while True:
            frames: list[Any] = await self._socket.recv_multipart()
            if len(frames) != 2:
                log.warning("join endpoint: dropped a message of %d frames", len(frames))
                continue
            reply = self._answer(frames[1])
            await self._socket.send_multipart([frames[0], encode(reply)])

    def _answer(self, data: bytes) -> AnyMessage:
        try:
            message = decode(data)
        except DecodeError as exc:
            return _refused("malformed", f"not a join message: {exc}")
        if not isinstance(message, AgentJoin):
            what = type(message).__name__
            return _refused("malformed", f"the join endpoint takes AgentJoin, not {what}")
        return self._join(message)

    def _join(self, join: AgentJoin) -> AnyMessage:
        host = join.host_id
        try:
            check_host_name(host)
            CurveKeys(join.public_key.encode(), join.public_key.encode())  # checks its form
        except (ConfigError, TransportError) as exc:
            return _refused("malformed", f"join of {host!r}: {exc}")
        why = self._verifier.check(host, join.public_key, join.nonce, join.timestamp, join.proof)
        if why is not None:
            return _refused(why, f"join of host {host} refused: {_REASONS[why]}")
        try:
            new = pin_host_key(self._keys, host, join.public_key.encode())
        except ConfigError:
            return _refused(
                "host_taken",
                f"join of host {host} refused: another key is pinned for it; if that host is "
                f"gone for good, delete {self._keys}/hosts/{host}.key on the gateway and restart "
                "the gateway",
            )
        self._admit(join.public_key.encode())
        log.info("host %s %s, key %s", host, "joined" if new else "joined again", join.public_key)
        return AgentJoined(host, join.public_key)


_REASONS: dict[JoinRefusalKind, str] = {
    "bad_proof": "its proof does not match the join token (another cluster's token?)",
    "expired": "its time is too far from the gateway's (clocks out of step, or a replay)",
    "replayed": "this join was seen before (a replay)",
}


def _refused(kind: JoinRefusalKind, message: str) -> JoinRefused:
    log.warning("%s", message)
    return JoinRefused(kind, message)
