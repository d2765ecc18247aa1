"""Decoded wire messages from a ``Transport``: the receive loop every endpoint starts with."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from nbos.core.errors import DecodeError, TransportClosedError
from nbos.core.ids import PeerId
from nbos.core.transport import Transport
from nbos.core.wire import AnyMessage, decode

log = logging.getLogger(__name__)


async def received_messages(
    transport: Transport, owner: str
) -> AsyncIterator[tuple[PeerId, AnyMessage]]:
    """Every message ``transport`` receives, decoded, with its sender, until it closes.

    A payload that does not decode is logged (naming ``owner``) and skipped, so a
    bad or hostile peer never stops the loop; a closed transport ends it.
    """
    while True:
        try:
            sender, data = await transport.receive()
        except TransportClosedError:
            log.info("%s: transport closed", owner)
            return
        try:
            message = decode(data)
        except DecodeError as exc:
            log.warning("%s dropped a message from %s: %s", owner, sender, exc)
            continue
        yield sender, message
