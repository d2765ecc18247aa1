"""A ``Transport`` that shares one ZeroMQ endpoint with its owner, who reads for both.

A daemon with one endpoint (an agent, the gateway) reads every message once and
hands some of them, undecoded, to a component that speaks ``Transport`` (the
host agent's GPU service, the GPU scheduler) through this link's inbox: its sends
go straight out, its receives come from the inbox.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from nbos.core.errors import TransportClosedError
from nbos.core.ids import PeerId
from nbos.transport.zmq import ZmqTransport


class InboxLink:
    """Sends through ``transport``; receives what the owner put into ``inbox``.

    ``add_peer`` connects with the CURVE server key ``server_keys`` holds for the
    peer (none: plain), since a component speaking ``Transport`` knows no keys.
    """

    def __init__(
        self,
        transport: ZmqTransport,
        inbox: MemoryObjectReceiveStream[tuple[PeerId, bytes]],
        server_keys: Mapping[PeerId, bytes],
    ) -> None:
        self._transport = transport
        self._inbox = inbox
        self._keys = server_keys

    @property
    def local(self) -> PeerId:
        return self._transport.local

    @property
    def dropped(self) -> int:
        return self._transport.dropped

    def add_peer(self, peer: PeerId, address: str) -> None:
        self._transport.add_peer(peer, address, server_key=self._keys.get(peer))

    def remove_peer(self, peer: PeerId) -> None:
        self._transport.remove_peer(peer)

    async def send(self, peer: PeerId, payload: bytes) -> None:
        await self._transport.send(peer, payload)

    async def receive(self) -> tuple[PeerId, bytes]:
        try:
            return await self._inbox.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise TransportClosedError("the link's inbox is closed") from None

    async def aclose(self) -> None:
        await self._inbox.aclose()
