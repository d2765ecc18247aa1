"""Jupyter messages in and out of the front: strict parsing, re-signing, sending."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import Session

from nbos.core.errors import AuthenticationError, DecodeError

log = logging.getLogger(__name__)

Msg = dict[str, Any]


def session_for(connection: Mapping[str, Any], *, username: str = "nbos") -> Session:
    """A ``Session`` that signs with the key and scheme of ``connection``."""
    key = connection.get("key", "")
    return Session(
        key=key.encode() if isinstance(key, str) else bytes(key),
        signature_scheme=connection.get("signature_scheme", "hmac-sha256"),
        username=username,
    )


def parse(session: Session, frames: Sequence[bytes], *, content: bool) -> tuple[list[bytes], Msg]:
    """Split identities off and verify and decode one message.

    Raises :class:`AuthenticationError` for an unsigned or wrongly signed message and
    :class:`DecodeError` for anything else that is not a well-formed Jupyter message.
    """
    try:
        idents, rest = session.feed_identities(list(frames), copy=True)
        msg = session.deserialize(rest, content=content, copy=True)
    except ValueError as exc:
        text = str(exc)
        if "Signature" in text or "Unsigned" in text:
            raise AuthenticationError(text) from exc
        raise DecodeError(f"malformed Jupyter message: {text}") from exc
    except (TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise DecodeError(f"malformed Jupyter message: {exc!r}") from exc
    header = msg.get("header")
    if not isinstance(header, dict) or not isinstance(header.get("msg_id"), str):
        raise DecodeError("Jupyter message without a header msg_id")
    if not isinstance(header.get("msg_type"), str):
        raise DecodeError("Jupyter message without a msg_type")
    if content and not isinstance(msg.get("content"), dict):
        raise DecodeError("Jupyter message content is not an object")
    if not isinstance(msg.get("metadata"), dict) or not isinstance(msg.get("parent_header"), dict):
        raise DecodeError("Jupyter message metadata or parent_header is not an object")
    return idents, msg


async def send(
    session: Session,
    socket: zmq.asyncio.Socket,
    msg: Msg,
    idents: Sequence[bytes] = (),
    *,
    session_id: str | None = None,
) -> None:
    """Sign ``msg`` with ``session`` and send it; ``session_id`` rewrites its header's session.

    ``msg`` is a parsed message (content a dict, or the raw packed bytes when relayed).
    """
    header = msg["header"]
    if session_id is not None and header.get("session") != session_id:
        header = {**header, "session": session_id}
    out = {
        "header": header,
        "parent_header": msg.get("parent_header", {}),
        "metadata": msg.get("metadata", {}),
        "content": msg.get("content", {}),
    }
    frames: list[Any] = session.serialize(out, list(idents))
    frames.extend(msg.get("buffers", ()))
    await socket.send_multipart(frames, copy=False)


def new_message(
    session: Session, msg_type: str, content: dict[str, Any], parent: Msg | None = None
) -> Msg:
    """A fresh message of ``session`` (its own msg_id and session id)."""
    msg: Msg = session.msg(msg_type, content, parent=parent)
    return msg
