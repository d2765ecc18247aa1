"""Jupyter messages in and out of the front: strict parsing, signing, re-signing.

Every message a cell produces crosses the front twice (replica to front, front to
client), so this is the front's hot path. It follows the wire format of
``jupyter_client.session`` (identities, ``<IDS|MSG>``, HMAC over the four JSON
frames, buffers) but decodes JSON with msgspec and leaves dates as the ISO strings
they arrived as: a relayed message is re-signed, never re-interpreted. The content of
what a replica publishes (a cell's output: the bulk of what crosses the front) is not
even decoded: it goes on as the bytes it arrived as (:class:`Unparsed`), signed again.
"""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgspec
from jupyter_client.session import DELIM, Session

from nbos.core.errors import AuthenticationError, DecodeError

log = logging.getLogger(__name__)

Msg = dict[str, Any]

#: How many recent signatures are remembered to refuse a replayed message.
_REPLAY_WINDOW = 1 << 16

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


@attrs.frozen
class Unparsed:
    """A message's JSON part relayed as it arrived: its signature checked, never decoded."""

    data: bytes


class Signer:
    """Verifies, decodes, encodes and signs the messages of one key.

    ``session`` (a ``jupyter_client`` ``Session`` with the same key) makes fresh
    messages; its session id is the one they carry.
    """

    def __init__(
        self,
        connection: Mapping[str, Any],
        *,
        username: str = "nbos",
        session_id: str | None = None,
    ) -> None:
        key = connection.get("key", "")
        # ``session_id``: keep an earlier one (a front taking its kernel over); else fresh.
        extra = {} if session_id is None else {"session": session_id}
        self.session = Session(
            key=key.encode() if isinstance(key, str) else bytes(key),
            signature_scheme=connection.get("signature_scheme", "hmac-sha256"),
            username=username,
            **extra,
        )
        self._recent: OrderedDict[bytes, None] = OrderedDict()

    def parse(self, frames: Sequence[bytes], *, content: bool = True) -> tuple[list[bytes], Msg]:
        """Split identities off, verify the signature and decode one message; without
        ``content``, its content stays :class:`Unparsed` unless it is a ``status``'s.

        Raises :class:`AuthenticationError` for an unsigned, wrongly signed or replayed
        message and :class:`DecodeError` for anything else not a Jupyter message.
        """
        try:
            split = list(frames).index(DELIM)
        except ValueError:
            raise DecodeError("no <IDS|MSG> delimiter") from None
        idents, rest = list(frames[:split]), frames[split + 1 :]
        if len(rest) < 5:
            raise DecodeError(f"{len(rest)} frames after the delimiter, at least 5 expected")
        self._verify(rest[0], rest[1:5])
        try:
            header, parent, metadata = (_decode_json(f) for f in rest[1:4])
            decoded = content or (isinstance(header, dict) and header.get("msg_type") == "status")
            body = _decode_json(rest[4]) if decoded else Unparsed(bytes(rest[4]))
        except msgspec.DecodeError as exc:
            raise DecodeError(f"a frame is not JSON: {exc}") from exc
        msg = _checked(header, parent, metadata, body)
        msg["buffers"] = list(rest[5:])
        return idents, msg

    def frames(
        self, msg: Msg, idents: Sequence[bytes] = (), *, session_id: str | None = None
    ) -> list[bytes]:
        """``msg`` signed with this key; ``session_id`` rewrites its header's session."""
        header = msg["header"]
        if session_id is not None and header.get("session") != session_id:
            header = {**header, "session": session_id}
        parts = [
            _encode_json(header),
            _encode_json(msg.get("parent_header", {})),
            _encode_json(msg.get("metadata", {})),
            _encoded_content(msg.get("content", {})),
        ]
        return [*idents, DELIM, self.session.sign(parts), *parts, *msg.get("buffers", ())]

    def new_message(self, msg_type: str, content: dict[str, Any], parent: Msg | None = None) -> Msg:
        """A fresh message of this signer's session (its own msg_id and session id)."""
        msg: Msg = self.session.msg(msg_type, content, parent=parent)
        return msg

    def _verify(self, signature: bytes, parts: Sequence[bytes]) -> None:
        if self.session.auth is None:
            return
        if not signature:
            raise AuthenticationError("unsigned message")
        if signature in self._recent:
            raise AuthenticationError("replayed message (duplicate signature)")
        if not hmac.compare_digest(signature, self.session.sign(list(parts))):
            raise AuthenticationError("invalid signature")
        self._recent[signature] = None
        if len(self._recent) > _REPLAY_WINDOW:
            self._recent.popitem(last=False)


def _checked(header: Any, parent: Any, metadata: Any, content: Any) -> Msg:
    if not isinstance(header, dict) or not isinstance(header.get("msg_id"), str):
        raise DecodeError("Jupyter message without a header msg_id")
    if not isinstance(header.get("msg_type"), str):
        raise DecodeError("Jupyter message without a msg_type")
    if not isinstance(parent, dict) or not isinstance(metadata, dict):
        raise DecodeError("Jupyter message parent_header or metadata is not an object")
    if not isinstance(content, dict | Unparsed):
        raise DecodeError("Jupyter message content is not an object")
    return {
        "header": header,
        "msg_id": header["msg_id"],
        "msg_type": header["msg_type"],
        "parent_header": parent,
        "metadata": metadata,
        "content": content,
    }


def _encoded_content(content: Any) -> bytes:
    return content.data if isinstance(content, Unparsed) else _encode_json(content)
