"""The wire format: every message round-trips; arbitrary bytes only ever raise DecodeError."""

from __future__ import annotations

import contextlib
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbos.core.errors import DecodeError
from nbos.core.wire import PROTOCOL_VERSION, AnyMessage, Envelope, decode, encode
from nbos.core.wire.liveness import Ping
from tests.core.wire_strategies import for_struct

MESSAGE_TYPES: list[type[msgspec.Struct]] = list(typing.get_args(AnyMessage))


def test_every_message_type_is_in_the_union_once() -> None:
    tags = [t.__struct_config__.tag for t in MESSAGE_TYPES]
    assert len(tags) == len(set(tags)), "tags must be unique across the wire format"
    assert len(MESSAGE_TYPES) >= 2


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=30)
@given(data=st.data())
def test_message_round_trips(message_type: type[msgspec.Struct], data: st.DataObject) -> None:
    message = data.draw(for_struct(message_type))
    assert decode(encode(message)) == message  # type: ignore[arg-type]


@settings(max_examples=500)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_decode_error(blob: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(blob)


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0))
def test_corrupted_valid_message_raises_only_decode_error(noise: bytes, at: int) -> None:
    good = bytearray(encode(Ping(nonce=7)))
    at %= len(good)
    good[at : at + len(noise)] = noise
    with contextlib.suppress(DecodeError):
        decode(bytes(good))


def test_truncated_message_is_a_decode_error() -> None:
    data = encode(Ping(nonce=123456))
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decode(data[:cut])


def test_unknown_tag_is_a_decode_error() -> None:
    raw = msgspec.msgpack.encode([PROTOCOL_VERSION, {"t": "NoSuchMessage", "nonce": 1}])
    with pytest.raises(DecodeError, match="malformed"):
        decode(raw)


def test_wrong_field_type_is_a_decode_error() -> None:
    raw = msgspec.msgpack.encode([PROTOCOL_VERSION, {"t": "Ping", "nonce": "one"}])
    with pytest.raises(DecodeError, match="int"):
        decode(raw)


def test_unknown_field_is_refused() -> None:
    raw = msgspec.msgpack.encode([PROTOCOL_VERSION, {"t": "Ping", "nonce": 1, "extra": 2}])
    with pytest.raises(DecodeError):
        decode(raw)


def test_other_protocol_version_is_named() -> None:
    raw = msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION + 1, Ping(nonce=1)))
    with pytest.raises(DecodeError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        decode(raw)
