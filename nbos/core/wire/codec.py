"""Encoding and strict decoding of every nbos message.

Bytes on a wire are a msgpack ``Envelope``: the protocol version and one
message of the tagged union :data:`AnyMessage`. Decoding never raises anything
but :class:`~nbos.core.errors.DecodeError`, whatever the bytes.
"""

from __future__ import annotations

import logging

import msgspec

from nbos.core.errors import DecodeError
from nbos.core.wire.agent import AgentMessage
from nbos.core.wire.base import PROTOCOL_VERSION
from nbos.core.wire.entries import KernelEntry
from nbos.core.wire.liveness import LivenessMessage
from nbos.core.wire.log_commands import LogCommand
from nbos.core.wire.raft import RaftMessage
from nbos.core.wire.state import StateEntry

log = logging.getLogger(__name__)

AnyMessage = LivenessMessage | RaftMessage | AgentMessage | KernelEntry | LogCommand | StateEntry


class Envelope(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What travels: the sender's protocol version and the message."""

    version: int
    body: AnyMessage


class _VersionProbe(msgspec.Struct, array_like=True):
    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_probe = msgspec.msgpack.Decoder(_VersionProbe)
# msgspec reports malformed input through these; anything else escaping it is a bug
# we still refuse to let crash a process that reads from the network.
_DECODE_FAILURES = (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError)


def encode(message: AnyMessage) -> bytes:
    """Serialize ``message`` in an envelope of the current protocol version."""
    return _encoder.encode(Envelope(PROTOCOL_VERSION, message))


def decode(data: bytes) -> AnyMessage:
    """Strictly decode bytes made by :func:`encode`; raises ``DecodeError`` for anything else."""
    try:
        envelope = _decoder.decode(data)
    except _DECODE_FAILURES as exc:
        raise _explain(data, exc) from exc
    if envelope.version != PROTOCOL_VERSION:
        raise _version_error(envelope.version)
    return envelope.body


def _explain(data: bytes, exc: Exception) -> DecodeError:
    try:
        version = _probe.decode(data).version
    except _DECODE_FAILURES:
        version = PROTOCOL_VERSION
    if version != PROTOCOL_VERSION:
        return _version_error(version)
    return DecodeError(f"malformed message ({len(data)} bytes): {exc}")


def _version_error(version: int) -> DecodeError:
    log.warning("refused a message of protocol version %s (ours: %s)", version, PROTOCOL_VERSION)
    return DecodeError(f"protocol version {version} is not {PROTOCOL_VERSION}")
