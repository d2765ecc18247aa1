"""Requests to a Jupyter kernel over its own sockets, signed with its key.

The gateway's HTTP API asks a kernel's front (an interrupt, a nudge of IOPub); a host's
agent asks a replica it runs to move its tensors off devices another kernel needs (lazy
eviction). Both are plain Jupyter clients of the kernel's connection info.

A kernel whose connection info holds a CURVE key pair (Jupyter's ``curve_publickey`` and
``curve_secretkey``, which a replica of a cluster with keys writes, see ``docs/deploy.md``)
is a CURVE server of that pair on all five channels and admits only clients of the same
pair: :func:`connect` makes such a client (the front's sockets to a replica, and these).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from nbos.transport.zmq import CurveKeys, curve_client


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


def curve_of(info: Mapping[str, Any]) -> CurveKeys | None:
    """The CURVE key pair of the kernel of ``info``; ``None`` where it has none.

    Raises :class:`~nbos.core.errors.TransportError` when only one key is there or a key
    is malformed.
    """
    public, secret = info.get("curve_publickey", ""), info.get("curve_secretkey", "")
    if not public and not secret:
        return None
    return CurveKeys(_key_bytes(secret), _key_bytes(public))


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def connect(
    sock: zmq.Socket[Any], info: Mapping[str, Any], channel: str, curve: CurveKeys | None
) -> None:
    """Connect ``sock`` to ``channel`` of the kernel of ``info``, a CURVE client of
    ``curve``, the kernel's key pair (:func:`curve_of`), where it has one."""
    if curve is not None:
        curve_client(sock, curve, None)  # the server's key is the pair's own
    sock.connect(channel_url(info, channel))


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
        connect(sock, info, "control", curve_of(info))
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
