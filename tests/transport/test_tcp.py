"""TcpTransport specifics: malformed input on its sockets, addresses, its event loop."""

from __future__ import annotations

import logging
import socket
import struct

import anyio
import pytest

from nbos.core.errors import TransportError
from nbos.core.ids import PeerId
from nbos.transport import TcpTransport
from nbos.transport.tcp import parse_address
from tests._wait import eventually

pytestmark = pytest.mark.anyio


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _port(transport: TcpTransport) -> int:
    return int(transport.address.rsplit(":", 1)[1])


async def test_malformed_connections_are_closed_and_reading_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        await TcpTransport.open("a", max_message_size=1000) as a,
        await TcpTransport.open("good") as good,
    ):
        bad_inputs = [
            b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)),  # not a frame at all
            _frame(b"hello, it's me"),  # a frame, but not a hello
            _frame(b"nbos-tcp/1 \xff\xfe"),  # a hello whose name is not UTF-8
            _frame(b"nbos-tcp/1 "),  # a hello without a name
            _frame(b"nbos-tcp/1 rogue") + _frame(b"x" * 1001),  # then a frame over the limit
        ]
        raw = [socket.create_connection(("127.0.0.1", _port(a))) for _ in bad_inputs]
        try:
            with caplog.at_level(logging.WARNING, logger="nbos.transport.tcp"):
                for sock, data in zip(raw, bad_inputs, strict=True):
                    sock.sendall(data)
                good.add_peer(a.local, a.address)
                await good.send(a.local, b"well formed")
                with anyio.fail_after(30):
                    assert await a.receive() == ("good", b"well formed")
                await eventually(lambda: a.rejected >= len(bad_inputs), timeout=30)
                for sock in raw:  # a closes each: the peer reads end of file
                    sock.settimeout(30)
                    assert sock.recv(1) == b""
            assert a.rejected == len(bad_inputs)
            assert sum("closed a connection" in r.message for r in caplog.records) == a.rejected
            with anyio.move_on_after(0.2):
                unexpected = await a.receive()
                pytest.fail(f"only one well-formed message was sent, got {unexpected}")
        finally:
            for sock in raw:
                sock.close()


async def test_a_frame_split_into_single_bytes_arrives_whole() -> None:
    async with await TcpTransport.open("a") as a:
        data = _frame(b"nbos-tcp/1 slow") + _frame(b"one") + _frame(b"x" * 100_000)
        with socket.create_connection(("127.0.0.1", _port(a))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(0, 40):  # the first bytes one at a time, the rest at once
                sock.sendall(data[i : i + 1])
                await anyio.sleep(0.001)  # a read of its own for each
            sock.sendall(data[40:])
            with anyio.fail_after(30):
                assert await a.receive() == ("slow", b"one")
                assert await a.receive() == ("slow", b"x" * 100_000)


def test_addresses_are_parsed_or_refused_with_a_typed_error() -> None:
    assert parse_address("tcp://10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_address("tcp://[::1]:7000") == ("::1", 7000)
    assert parse_address("tcp://*:0", bind=True) == ("0.0.0.0", 0)
    assert parse_address("tcp://host-1:0", bind=True) == ("host-1", 0)
    for bad in ("no scheme at all", "udp://1.2.3.4:5", "tcp://1.2.3.4", "tcp://:5", "tcp://h:x"):
        with pytest.raises(TransportError, match="tcp://host:port"):
            parse_address(bad)
    for bad in ("tcp://h:0", "tcp://h:70000"):
        with pytest.raises(TransportError, match="bad port"):
            parse_address(bad)
    with pytest.raises(TransportError, match="wildcard"):
        parse_address("tcp://*:5")


async def test_wildcard_bind_listens_on_every_interface() -> None:
    async with await TcpTransport.open("a", "tcp://*:0") as a, await TcpTransport.open("b") as b:
        assert a.address.startswith("tcp://0.0.0.0:")
        b.add_peer(a.local, f"tcp://127.0.0.1:{_port(a)}")
        await b.send(a.local, b"hi")
        with anyio.fail_after(30):
            assert await a.receive() == (PeerId("b"), b"hi")


def test_opening_outside_an_asyncio_loop_is_a_typed_error() -> None:
    with pytest.raises(TransportError, match="asyncio"):
        TcpTransport(PeerId("a"), queue_size=10, max_message_size=100)
