"""What both real transports (ZeroMQ and plain TCP) do over real sockets: restarts of
real processes, vanished and late peers, typed errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from nbos.core.errors import ConfigError, TransportError
from nbos.core.ids import PeerId
from nbos.transport import TcpTransport, ZmqTransport
from tests.transport.conftest import free_tcp_address, peer

pytestmark = pytest.mark.anyio

ECHO_PEER = Path(__file__).with_name("echo_peer.py")
REPO_ROOT = Path(__file__).parents[2]

Real = type[ZmqTransport] | type[TcpTransport]
Endpoint = ZmqTransport | TcpTransport


@pytest.fixture(params=["zmq", "tcp"])
def real(request: pytest.FixtureRequest) -> Real:
    return TcpTransport if request.param == "tcp" else ZmqTransport


@asynccontextmanager
async def echo_process(real: Real, bind: str, back_to: Endpoint) -> AsyncIterator[tuple[int, str]]:
    """Start echo_peer.py; yields its pid and bound address; kills it (by pid) at exit."""
    kind = "tcp" if real is TcpTransport else "zmq"
    args = [sys.executable, str(ECHO_PEER), kind, "echo", bind, back_to.local, back_to.address]
    async with await anyio.open_process(args, cwd=REPO_ROOT, stderr=subprocess.DEVNULL) as proc:
        try:
            assert proc.stdout is not None
            with anyio.fail_after(20):
                line = b""
                while not line.endswith(b"\n"):
                    line += await proc.stdout.receive()
            yield proc.pid, line.decode().strip()
        finally:
            proc.kill()
            await proc.wait()


async def round_trip(transport: Endpoint, to: PeerId, payload: bytes, within: float) -> None:
    """Send until the echo of ``payload`` comes back (earlier sends may be lost)."""
    with anyio.fail_after(within):
        while True:
            await transport.send(to, payload)
            with anyio.move_on_after(0.2):
                while True:
                    if await transport.receive() == (to, payload):
                        return


async def test_peer_process_killed_and_restarted_on_the_same_port_is_reached_again(
    real: Real,
) -> None:
    async with await real.open("a") as a:
        echo = PeerId("echo")
        async with echo_process(real, "tcp://127.0.0.1:0", a) as (pid, address):
            a.add_peer(echo, address)
            await round_trip(a, echo, b"first life", within=10)
        # echo_process killed it with SIGKILL: no goodbye on any socket.
        await a.send(echo, b"into the void")
        async with echo_process(real, address, a) as (pid2, address2):
            assert pid2 != pid
            assert address2 == address
            await round_trip(a, echo, b"second life", within=10)


async def test_vanished_peer_queue_is_bounded_and_sends_never_block(real: Real) -> None:
    async with await real.open("a", queue_size=10) as a:
        a.add_peer(peer("gone"), free_tcp_address())
        with anyio.fail_after(20):  # a blocked send would wait for ever
            for _ in range(1000):
                await a.send(peer("gone"), b"x" * 100)
        assert a.dropped == 990


async def test_queued_messages_reach_a_peer_that_starts_late(real: Real) -> None:
    address = free_tcp_address()
    async with await real.open("a") as a:
        a.add_peer(peer("late"), address)
        for i in range(5):
            await a.send(peer("late"), bytes([i]))
        async with await real.open("late", address) as late:
            with anyio.fail_after(20):
                got = [await late.receive() for _ in range(5)]
        assert sorted(got) == [("a", bytes([i])) for i in range(5)]


async def test_oversized_payload_is_refused_with_a_typed_error(real: Real) -> None:
    async with await real.open("a", max_message_size=1000) as a:
        a.add_peer(peer("b"), free_tcp_address())
        with pytest.raises(TransportError, match="exceeds"):
            await a.send(peer("b"), b"x" * 1001)


async def test_bad_bind_address_and_queue_size_are_typed_errors(real: Real) -> None:
    async with await real.open("a") as a:
        with pytest.raises(TransportError, match="cannot bind"):
            await real.open("b", a.address)  # already taken
    with pytest.raises(ConfigError):
        await real.open("c", queue_size=0)
    for bad_id in ("", "\0zmq-reserved", "x" * 256):
        with pytest.raises(ConfigError):
            await real.open(bad_id)


async def test_re_adding_a_peer_keeps_or_replaces_its_connection(real: Real) -> None:
    async with await real.open("a") as a, await real.open("b") as b:
        a.add_peer(b.local, free_tcp_address())
        a.add_peer(b.local, b.address)
        a.add_peer(b.local, b.address)  # same address: kept, no duplicate connection
        await a.send(b.local, b"to the new address")
        with anyio.fail_after(20):
            assert await b.receive() == ("a", b"to the new address")
        with anyio.move_on_after(0.2) as scope:
            await b.receive()
        assert scope.cancelled_caught
