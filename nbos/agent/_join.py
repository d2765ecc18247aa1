"""An agent joins its gateway with a join token (``nbos.transport.join``) before it serves.

It sends :class:`~nbos.core.wire.agent.AgentJoin` from a DEALER that is a CURVE client of
the gateway's key in the token, over and over (a new nonce each time) until the gateway
answers: the gateway may start after its agents (Swarm starts services in any order).
``AgentJoined`` lets the agent on; ``JoinRefused`` ends it (:class:`JoinRefusedError`):
a wrong token or a host name pinned to another key does not mend by retrying.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import zmq
import zmq.asyncio

from nbos.core.errors import DecodeError, JoinRefusedError
from nbos.core.wire import decode, encode
from nbos.core.wire.agent import AgentJoin, AgentJoined, JoinRefused
from nbos.transport.join import JoinToken, join_proof, new_nonce
from nbos.transport.zmq import CurveKeys, curve_client

log = logging.getLogger(__name__)

#: How long one try waits for the gateway's answer.
_TRY_S = 2.0
# Say so, once, when the gateway has not answered for this long.
_SILENCE_WARNING_S = 30.0


async def join_gateway(token: JoinToken, address: str, host: str, keys: CurveKeys) -> None:
    """Return once the gateway at ``address`` pinned ``keys.public_key`` for ``host``."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    curve_client(socket, keys, token.gateway_public)
    socket.connect(address)
    started, warned = anyio.current_time(), False
    try:
        while True:
            await socket.send(encode(_join(token, host, keys.public_key.decode())))
            with anyio.move_on_after(_TRY_S):
                if _accepted(await socket.recv(), host):
                    log.info("host %s joined the gateway at %s", host, address)
                    return
            if not warned and anyio.current_time() - started > _SILENCE_WARNING_S:
                warned = True
                log.warning("host %s: no answer from the join endpoint %s yet", host, address)
    finally:
        context.destroy(linger=0)


def _join(token: JoinToken, host: str, public_key: str) -> AgentJoin:
    nonce, now = new_nonce(), time.time()
    return AgentJoin(host, public_key, nonce, now, join_proof(token, host, public_key, nonce, now))


def _accepted(data: Any, host: str) -> bool:
    try:
        reply = decode(data)
    except DecodeError as exc:
        log.warning("host %s: undecodable answer to its join: %s", host, exc)
        return False
    if isinstance(reply, JoinRefused):
        log.error("host %s: %s", host, reply.message)
        raise JoinRefusedError(reply.kind, reply.message)
    return isinstance(reply, AgentJoined) and reply.host_id == host
