"""Liveness messages any two nbos endpoints may exchange."""

from __future__ import annotations

from nbos.core.wire.base import Message


class Ping(Message):
    """Asks the receiver to answer with a :class:`Pong` carrying the same nonce."""

    nonce: int


class Pong(Message):
    """Answer to :class:`Ping`."""

    nonce: int


LivenessMessage = Ping | Pong
