"""Fixtures for the transport tests: one harness per Transport implementation."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence

import pytest

from nbos.core.ids import PeerId
from nbos.core.transport import Transport
from nbos.transport import MemoryNetwork, TcpTransport, ZmqTransport


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_tcp_address() -> str:
    """A loopback address that nothing listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class Harness:
    """Opens endpoints of one implementation and closes them at the end of a test."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.network = MemoryNetwork(seed=7)
        self.opened: list[Transport] = []

    async def open(self, peer: str, *, queue_size: int = 1000) -> Transport:
        return await self.reopen(peer, None, queue_size=queue_size)

    async def reopen(self, peer: str, address: str | None, *, queue_size: int = 1000) -> Transport:
        """Open ``peer``'s endpoint at ``address`` (a fresh one if ``None``)."""
        transport: Transport
        if self.kind == "memory":
            transport = self.network.endpoint(peer, queue_size=queue_size)
        else:
            bind = address or "tcp://127.0.0.1:0"
            kind = TcpTransport if self.kind == "tcp" else ZmqTransport
            transport = await kind.open(peer, bind, queue_size=queue_size)
        self.opened.append(transport)
        return transport

    @staticmethod
    def address(transport: Transport) -> str:
        address = getattr(transport, "address", None)
        assert isinstance(address, str)
        return address

    def dead_address(self) -> str:
        """An address no endpoint listens on."""
        return "mem://nobody-here" if self.kind == "memory" else free_tcp_address()

    async def mesh(self, *peers: str, queue_size: int = 1000) -> list[Transport]:
        """Endpoints for ``peers``, each knowing the address of every other."""
        endpoints = [await self.open(p, queue_size=queue_size) for p in peers]
        connect(endpoints)
        return endpoints

    async def close_all(self) -> None:
        for transport in self.opened:
            await transport.aclose()


def connect(endpoints: Sequence[Transport]) -> None:
    for a in endpoints:
        for b in endpoints:
            if a is not b:
                a.add_peer(b.local, Harness.address(b))


@pytest.fixture(params=["memory", "zmq", "tcp"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h = Harness(request.param)
    yield h
    await h.close_all()


def peer(name: str) -> PeerId:
    return PeerId(name)
