"""Requests to a Jupyter kernel over its own sockets, signed with its key.

The gateway's HTTP API asks a kernel's front (an interrupt, a nudge of IOPub); a host's
agent asks a replica it runs to move its tensors off devices another kernel needs (lazy
eviction). Both are plain Jupyter clients of the kernel's connection info.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import zmq
import zmq.asyncio
from jupyter_client.session import Session


def session_for(info: Mapping[str, Any]) -> Session:
    """A Jupyter session that signs and checks messages with the key of ``info``."""
    key = info["key"]
    return Session(
        key=key.encode() if isinstance(key, str) else key,
        signature_scheme=info.get("signature_scheme", "hmac-sha256"),
        username="nbos",
    )


def channel_url(info: Mapping[str, Any], channel: str) -> str:
    """Where ``channel`` (``shell``, ``iopub`` ...) of the kernel of ``info`` listens."""
    return f"{info.get('transport', 'tcp')}://{info['ip']}:{info[f'{channel}_port']}"


async def control_request(
    ctx: zmq.asyncio.Context,
    info: Mapping[str, Any],
    msg_type: str,
    content: dict[str, Any],
    timeout: float,
) -> dict[str, Any] | None:
    """Send one request on the kernel's control channel; its reply, ``None`` after ``timeout``."""
    session = session_for(info)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(channel_url(info, "control"))
        request = session.msg(msg_type, content)
        await sock.send_multipart(session.serialize(request))
        with anyio.move_on_after(timeout):
            while True:
                _, parts = session.feed_identities(await sock.recv_multipart())
                reply: dict[str, Any] = session.deserialize(parts)
                if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
                    return reply
        return None
    finally:
        sock.close(0)
