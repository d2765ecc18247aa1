"""The ``Transport`` interface: addressed, unordered, lossy datagrams between peers."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from nbos.core.ids import PeerId


@runtime_checkable
class Transport(Protocol):
    """Carries opaque byte payloads between named peers.

    Contract, shared by every implementation and checked by one test suite:

    * **Addressing.** A transport has one ``local`` peer id. ``send`` takes a peer
      id; the implementation maps it to an address (``add_peer``). Sending to a
      peer with no known address raises :class:`~nbos.core.errors.UnknownPeerError`.
    * **Delivery.** At most once per ``send`` under normal operation, no ordering
      promise across sends, and no delivery promise at all: messages may be lost
      when a peer is down or a queue overflows. Protocols on top (Raft, the agent
      RPCs) retry. A payload is delivered whole or not at all, never truncated.
    * **Back-pressure.** ``send`` never blocks for long: each peer has a bounded
      outbound queue; when it is full the *new* message is dropped and counted in
      ``dropped``. A slow or dead peer therefore cannot stall its senders.
    * **Reconnection.** A peer that restarts on the same address is reached again
      without any call on this side.
    * **Cancellation.** Cancelling ``receive`` loses no message: a message is either
      returned or stays queued.
    * **Closing.** After ``aclose`` every ``send`` and ``receive`` raises
      :class:`~nbos.core.errors.TransportClosedError`; a ``receive`` blocked at the
      time of closing raises it too. ``aclose`` is idempotent.
    """

    @property
    def local(self) -> PeerId:
        """This endpoint's own peer id."""
        ...

    @property
    def dropped(self) -> int:
        """How many outbound messages were dropped for overflow since start."""
        ...

    def add_peer(self, peer: PeerId, address: str) -> None:
        """Learn (or update) where ``peer`` is reached."""
        ...

    def remove_peer(self, peer: PeerId) -> None:
        """Forget ``peer``; queued messages to it are discarded."""
        ...

    async def send(self, peer: PeerId, payload: bytes) -> None:
        """Queue ``payload`` for ``peer``; returns without waiting for delivery."""
        ...

    async def receive(self) -> tuple[PeerId, bytes]:
        """Wait for the next message; returns the sender's peer id and the payload."""
        ...

    async def aclose(self) -> None:
        """Close the endpoint and release its sockets and tasks."""
        ...
