"""Jupyter messages on a kernel's WebSocket, both ways, in the two protocols clients speak.

* the legacy protocol (no subprotocol; what Jupyter Server's gateway client
  speaks): a message is a JSON text frame with ``channel`` beside the message's
  parts; one with binary buffers is a binary frame (a big-endian ``uint32``
  count and offsets, the JSON part, then the buffers);
* ``v1.kernel.websocket.jupyter.org``: every message is a binary frame, a
  little-endian ``uint64`` count of offsets, the offsets, then the channel name
  and the parts exactly as ZeroMQ carries them (no JSON work on the way through).

A :class:`WireMsg` holds the parts as packed JSON, as the kernel's ZeroMQ frames do.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import attrs
import msgspec

from nbos.core.errors import DecodeError

V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"
#: Channels a client may send on (IOPub only flows to clients).
CLIENT_CHANNELS = frozenset({"shell", "control", "stdin"})

_PARTS = ("header", "parent_header", "metadata", "content")


@attrs.frozen
class WireMsg:
    """A Jupyter message: its channel, its four packed JSON parts and its buffers."""

    channel: str
    parts: tuple[bytes, bytes, bytes, bytes]
    buffers: tuple[bytes, ...] = ()


class _JsonMsg(msgspec.Struct):
    header: dict[str, Any]
    parent_header: dict[str, Any] = msgspec.field(default_factory=dict)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    content: dict[str, Any] = msgspec.field(default_factory=dict)
    channel: str = ""


_json_msg = msgspec.json.Decoder(_JsonMsg)


@attrs.frozen
class Frame:
    """A WebSocket frame's payload; ``text``: a text frame (UTF-8 JSON), else binary."""

    data: bytes
    text: bool


def encode(msg: WireMsg, header: dict[str, Any], protocol: str) -> Frame:
    """``msg`` as one WebSocket frame in ``protocol``.

    A text frame stays the bytes msgspec wrote (UTF-8 already): a flood's messages are
    MiBs, and each copy on the way is one more of them held.
    """
    if protocol == V1_PROTOCOL:
        return Frame(_frame_v1(msg.channel, [*msg.parts, *msg.buffers]), text=False)
    raw = dict(zip(_PARTS, map(msgspec.Raw, msg.parts), strict=True))
    body = {
        **raw,
        "msg_id": header.get("msg_id", ""),
        "msg_type": header.get("msg_type", ""),
        "channel": msg.channel,
    }
    if not msg.buffers:
        return Frame(msgspec.json.encode({**body, "buffers": []}), text=True)
    return Frame(_frame_legacy([msgspec.json.encode(body), *msg.buffers]), text=False)


def decode(frame: str | bytes, protocol: str) -> WireMsg:
    """A client's WebSocket frame as a message; :class:`DecodeError` if it is not one."""
    if isinstance(frame, str):
        return _from_json(frame.encode(), ())
    if protocol == V1_PROTOCOL:
        channel, parts = _split_v1(frame)
        if len(parts) < len(_PARTS):
            raise DecodeError(f"a v1 message needs {len(_PARTS)} parts, got {len(parts)}")
        return WireMsg(
            _channel(channel), (parts[0], parts[1], parts[2], parts[3]), tuple(parts[4:])
        )
    first, *buffers = _split_legacy(frame)
    return _from_json(first, tuple(buffers))


def _from_json(data: bytes, buffers: tuple[bytes, ...]) -> WireMsg:
    try:
        msg = _json_msg.decode(data)
    # msgspec lets a string that is not UTF-8 raise UnicodeDecodeError (msgspec#714).
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise DecodeError(f"not a Jupyter message: {exc}") from exc
    parts = (
        msgspec.json.encode(msg.header),
        msgspec.json.encode(msg.parent_header),
        msgspec.json.encode(msg.metadata),
        msgspec.json.encode(msg.content),
    )
    return WireMsg(_channel(msg.channel), parts, buffers)


def _channel(name: str) -> str:
    if name not in CLIENT_CHANNELS:
        raise DecodeError(f"no channel {name!r} to send on")
    return name


def _frame_v1(channel: str, parts: list[bytes]) -> bytes:
    pieces = [channel.encode(), *parts]
    # Offsets of each piece's start, then of the end: after the count and the offsets.
    at = 8 * (len(pieces) + 2)
    offsets = [at]
    for piece in pieces:
        at += len(piece)
        offsets.append(at)
    return struct.pack(f"<{len(offsets) + 1}Q", len(offsets), *offsets) + b"".join(pieces)


def _split_v1(frame: bytes) -> tuple[str, list[bytes]]:
    if len(frame) < 8:
        raise DecodeError("a v1 message shorter than its offset count")
    (count,) = struct.unpack_from("<Q", frame)
    if count < 2 or len(frame) < 8 * (count + 1):
        raise DecodeError(f"a v1 message with a bad offset count {count}")
    offsets = struct.unpack_from(f"<{count}Q", frame, 8)
    if (
        offsets[0] != 8 * (count + 1)
        or list(offsets) != sorted(offsets)
        or offsets[-1] > len(frame)
    ):
        raise DecodeError("a v1 message with offsets out of order or out of bounds")
    pieces = [frame[a:b] for a, b in itertools.pairwise(offsets)]
    try:
        channel = pieces[0].decode()
    except UnicodeDecodeError as exc:
        raise DecodeError("a v1 message whose channel is not UTF-8") from exc
    return channel, pieces[1:]


def _frame_legacy(pieces: list[bytes]) -> bytes:
    at = 4 * (len(pieces) + 1)
    offsets = []
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return struct.pack(f"!{len(pieces) + 1}I", len(pieces), *offsets) + b"".join(pieces)


def _split_legacy(frame: bytes) -> list[bytes]:
    if len(frame) < 4:
        raise DecodeError("a binary message shorter than its buffer count")
    (count,) = struct.unpack_from("!I", frame)
    if count < 1 or len(frame) < 4 * (count + 1):
        raise DecodeError(f"a binary message with a bad buffer count {count}")
    offsets = [*struct.unpack_from(f"!{count}I", frame, 4), len(frame)]
    if offsets[0] != 4 * (count + 1) or offsets != sorted(offsets):
        raise DecodeError("a binary message with offsets out of order or out of bounds")
    return [frame[a:b] for a, b in itertools.pairwise(offsets)]
