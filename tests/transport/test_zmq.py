"""ZmqTransport specifics: CURVE, malformed ZeroMQ input, its I/O thread
(what both real transports share is in test_real.py)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import anyio
import pytest
import zmq

from nbos.core.errors import TransportError
from nbos.core.ids import PeerId
from nbos.transport import CurveKeys, ZmqTransport
from tests._wait import eventually
from tests.transport.conftest import peer

pytestmark = pytest.mark.anyio


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


def test_opening_outside_an_asyncio_loop_is_a_typed_error() -> None:
    with pytest.raises(TransportError, match="asyncio"):
        ZmqTransport(
            PeerId("a"), bind="tcp://127.0.0.1:0", queue_size=10, curve=None, max_message_size=100
        )


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
