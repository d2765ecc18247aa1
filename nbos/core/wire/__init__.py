"""The wire format: one tagged union of msgspec Structs, strictly decoded."""

from nbos.core.wire.base import PROTOCOL_VERSION, Message
from nbos.core.wire.codec import AnyMessage, Envelope, decode, encode

__all__ = ["PROTOCOL_VERSION", "AnyMessage", "Envelope", "Message", "decode", "encode"]
