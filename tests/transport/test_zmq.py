"""ZmqTransport specifics: real restarts, CURVE, malformed input, vanished peers."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import zmq

from nbos.core.errors import ConfigError, TransportError
from nbos.core.ids import PeerId
from nbos.transport import CurveKeys, ZmqTransport
from tests._wait import eventually
from tests.transport.conftest import free_tcp_address, peer

pytestmark = pytest.mark.anyio

ECHO_PEER = Path(__file__).with_name("echo_peer.py")
REPO_ROOT = Path(__file__).parents[2]


@asynccontextmanager
async def echo_process(bind: str, back_to: ZmqTransport) -> AsyncIterator[tuple[int, str]]:
    """Start echo_peer.py; yields its pid and bound address; kills it (by pid) at exit."""
    args = [sys.executable, str(ECHO_PEER), "echo", bind, back_to.local, back_to.address]
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


async def round_trip(transport: ZmqTransport, to: PeerId, payload: bytes, within: float) -> None:
    """Send until the echo of ``payload`` comes back (earlier sends may be lost)."""
    with anyio.fail_after(within):
        while True:
            await transport.send(to, payload)
            with anyio.move_on_after(0.2):
                while True:
                    if await transport.receive() == (to, payload):
                        return


async def test_peer_process_killed_and_restarted_on_the_same_port_is_reached_again() -> None:
    async with await ZmqTransport.open("a") as a:
        echo = PeerId("echo")
        async with echo_process("tcp://127.0.0.1:0", a) as (pid, address):
            a.add_peer(echo, address)
            await round_trip(a, echo, b"first life", within=10)
        # echo_process killed it with SIGKILL: no goodbye on any socket.
        await a.send(echo, b"into the void")
        async with echo_process(address, a) as (pid2, address2):
            assert pid2 != pid
            assert address2 == address
            await round_trip(a, echo, b"second life", within=10)


async def test_vanished_peer_queue_is_bounded_and_sends_never_block() -> None:
    async with await ZmqTransport.open("a", queue_size=10) as a:
        a.add_peer(peer("gone"), free_tcp_address())
        with anyio.fail_after(20):  # a blocked send would wait for ever
            for _ in range(1000):
                await a.send(peer("gone"), b"x" * 100)
        assert a.dropped == 990


async def test_queued_messages_reach_a_peer_that_starts_late() -> None:
    address = free_tcp_address()
    async with await ZmqTransport.open("a") as a:
        a.add_peer(peer("late"), address)
        for i in range(5):
            await a.send(peer("late"), bytes([i]))
        async with await ZmqTransport.open("late", address) as late:
            with anyio.fail_after(20):
                got = [await late.receive() for _ in range(5)]
        assert sorted(got) == [("a", bytes([i])) for i in range(5)]


async def test_malformed_messages_are_dropped_and_reading_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with await ZmqTransport.open("a") as a:
        ctx = zmq.Context()
        try:
            named = ctx.socket(zmq.DEALER)
            named.setsockopt(zmq.ROUTING_ID, b"rogue")
            anonymous = ctx.socket(zmq.DEALER)  # ZeroMQ gives it a b"\0..." routing id
            bad_utf8 = ctx.socket(zmq.DEALER)
            bad_utf8.setsockopt(zmq.ROUTING_ID, b"\xff\xfe")
            for s in (named, anonymous, bad_utf8):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(a.address)
            named.send_multipart([b"too", b"many", b"frames"])
            anonymous.send(b"who am I")
            bad_utf8.send(b"payload")
            with socket.create_connection(("127.0.0.1", int(a.address.rsplit(":", 1)[1]))) as raw:
                raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
            named.send(b"well formed")
            with anyio.fail_after(30), caplog.at_level(logging.WARNING):
                assert await a.receive() == ("rogue", b"well formed")
                # The bad messages came on other connections: nothing orders them before
                # the good one, so go on reading (rejects are counted as the ROUTER is
                # read, not in the background). libzmq may also parse the raw bytes as
                # legacy ZMTP/1.0 frames: one more reject.
                while a.rejected < 3:
                    with anyio.move_on_after(0.05):
                        unexpected = await a.receive()
                        pytest.fail(f"only one well-formed message was sent, got {unexpected}")
            assert sum("malformed" in r.message for r in caplog.records) == a.rejected
        finally:
            ctx.destroy(linger=0)


def _io_threads() -> dict[int, int]:
    """This process's ZeroMQ I/O threads: their scheduling policy by thread id."""
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name.startswith("ZMQbg/IO"):
            threads[int(task.name)] = os.sched_getscheduler(int(task.name))
    return threads


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
async def test_the_io_thread_runs_as_a_batch_thread_so_a_send_does_not_preempt_the_sender() -> None:
    before = _io_threads()
    async with await ZmqTransport.open("a") as a:
        # The thread names itself once it has set its policy: wait for the name.
        await eventually(lambda: any(tid not in before for tid in _io_threads()), timeout=20)
        new = [policy for tid, policy in _io_threads().items() if tid not in before]
        assert new == [os.SCHED_BATCH]
        # Messages flow as ever.
        async with await ZmqTransport.open("b") as b:
            a.add_peer(peer("b"), b.address)
            await a.send(peer("b"), b"hello")
            with anyio.fail_after(20):
                assert await b.receive() == (peer("a"), b"hello")


async def test_oversized_payload_is_refused_with_a_typed_error() -> None:
    async with await ZmqTransport.open("a", max_message_size=1000) as a:
        a.add_peer(peer("b"), free_tcp_address())
        with pytest.raises(TransportError, match="exceeds"):
            await a.send(peer("b"), b"x" * 1001)


async def test_bad_bind_address_and_queue_size_are_typed_errors() -> None:
    async with await ZmqTransport.open("a") as a:
        with pytest.raises(TransportError, match="cannot bind"):
            await ZmqTransport.open("b", a.address)  # already taken
    with pytest.raises(ConfigError):
        await ZmqTransport.open("c", queue_size=0)
    for bad_id in ("", "\0zmq-reserved", "x" * 256):
        with pytest.raises(ConfigError):
            await ZmqTransport.open(bad_id)


def test_opening_outside_an_asyncio_loop_is_a_typed_error() -> None:
    with pytest.raises(TransportError, match="asyncio"):
        ZmqTransport(
            PeerId("a"), bind="tcp://127.0.0.1:0", queue_size=10, curve=None, max_message_size=100
        )


async def test_re_adding_a_peer_keeps_or_replaces_its_connection() -> None:
    async with await ZmqTransport.open("a") as a, await ZmqTransport.open("b") as b:
        a.add_peer(b.local, free_tcp_address())
        a.add_peer(b.local, b.address)
        a.add_peer(b.local, b.address)  # same address: kept, no duplicate connection
        await a.send(b.local, b"to the new address")
        with anyio.fail_after(20):
            assert await b.receive() == ("a", b"to the new address")
        with anyio.move_on_after(0.2) as scope:
            await b.receive()
        assert scope.cancelled_caught


# --- CURVE -------------------------------------------------------------------------


def keypair() -> tuple[bytes, bytes]:
    public, secret = zmq.curve_keypair()
    return secret, public


async def test_curve_admits_listed_keys_and_refuses_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (server_secret, server_public), (good_secret, good_public) = keypair(), keypair()
    bad_secret, bad_public = keypair()
    server_keys = CurveKeys(server_secret, server_public, frozenset({good_public}))
    caplog.set_level(logging.WARNING, logger="nbos.transport.zmq")
    async with (
        await ZmqTransport.open("server", curve=server_keys) as server,
        await ZmqTransport.open("good", curve=CurveKeys(good_secret, good_public)) as good,
        await ZmqTransport.open("bad", curve=CurveKeys(bad_secret, bad_public)) as bad,
        await ZmqTransport.open("plain") as plain,
    ):
        for client in (good, bad, plain):
            if client is plain:
                client.add_peer(server.local, server.address)
            else:
                client.add_peer(server.local, server.address, server_key=server_public)
            await client.send(server.local, client.local.encode())
        with anyio.fail_after(20):
            assert await server.receive() == ("good", b"good")
        with anyio.move_on_after(0.5) as scope:
            await server.receive()
        assert scope.cancelled_caught, "a refused client got a message through"
    refused = [r.message for r in caplog.records if "refused CURVE client key" in r.message]
    assert refused
    assert all(bad_public.decode() in m for m in refused)


async def test_curve_cluster_key_shared_by_all_members() -> None:
    keys = CurveKeys(*keypair())
    async with (
        await ZmqTransport.open("a", curve=keys) as a,
        await ZmqTransport.open("b", curve=keys) as b,
    ):
        a.add_peer(b.local, b.address)  # the server key defaults to the shared cluster key
        await a.send(b.local, b"members only")
        with anyio.fail_after(20):
            assert await b.receive() == ("a", b"members only")


def test_malformed_curve_keys_are_typed_errors() -> None:
    with pytest.raises(TransportError, match="Z85"):
        CurveKeys(b"short", b"x" * 40)
    secret, public = keypair()
    with pytest.raises(TransportError, match="Z85"):
        CurveKeys(secret, public, frozenset({b"nope"}))
