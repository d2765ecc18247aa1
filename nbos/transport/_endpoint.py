"""What the real transports (ZeroMQ, TCP) share: identity, settings, counters, closing."""

from __future__ import annotations

import abc
import logging
from typing import Self

import anyio.lowlevel

from nbos.core.errors import ConfigError, TransportClosedError, TransportError
from nbos.core.ids import PeerId

log = logging.getLogger(__name__)

# A receive that finds a message ready returns it at once, but every this many in a row
# it yields to the event loop, so a flood cannot starve the other tasks.
_YIELD_EVERY = 32


class Endpoint(abc.ABC):
    """One peer's endpoint on a real network; subclasses move the bytes."""

    def __init__(self, local: PeerId, *, queue_size: int, max_message_size: int) -> None:
        if queue_size < 1:
            raise ConfigError("queue_size", queue_size, "a positive number of messages")
        # ZeroMQ routing ids: 1 to 255 bytes, a leading zero byte reserved for its own;
        # the TCP hello keeps the same rule, so a peer id is valid on either transport.
        if not 0 < len(local.encode()) < 256 or local.startswith("\0"):
            raise ConfigError("local", local, "a peer id of 1 to 255 UTF-8 bytes, not starting NUL")
        if max_message_size < 1:
            raise ConfigError("max_message_size", max_message_size, "a positive number of bytes")
        self._local = local
        self._queue_size = queue_size
        self._max_message_size = max_message_size
        self._address = ""
        self._dropped = 0
        self._rejected = 0
        self._unyielded = 0
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the endpoint and release its sockets and tasks."""

    @property
    def local(self) -> PeerId:
        return self._local

    @property
    def address(self) -> str:
        """The bound address, with the real port; what peers pass to ``add_peer``."""
        return self._address

    @property
    def queue_size(self) -> int:
        return self._queue_size

    @property
    def max_message_size(self) -> int:
        return self._max_message_size

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def rejected(self) -> int:
        """How many malformed inbound messages (or connections) were dropped since start."""
        return self._rejected

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"transport {self._local!r} is closed")

    def _check_size(self, peer: PeerId, payload: bytes) -> None:
        size = len(payload)
        if size > self._max_message_size:
            log.warning("%s: refusing a %d-byte message to %s", self._local, size, peer)
            raise TransportError(f"payload of {size} bytes exceeds {self._max_message_size}")

    def _count_drop(self, peer: PeerId) -> None:
        self._dropped += 1
        log.debug("%s: queue to %s full, message dropped", self._local, peer)

    async def _took_a_waiting_message(self) -> None:
        """Call when a receive found its message waiting (no wait): every
        :data:`_YIELD_EVERY` in a row, others get a turn, with no cancellation
        point, since the message is taken."""
        self._unyielded += 1
        if self._unyielded >= _YIELD_EVERY:
            self._unyielded = 0
            await anyio.lowlevel.cancel_shielded_checkpoint()

    def _waited(self) -> None:
        """Call when a receive had to wait: the run of waiting messages is over."""
        self._unyielded = 0
