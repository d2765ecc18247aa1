"""The Transport contract, run against every implementation (see nbos.core.transport)."""

from __future__ import annotations

import os
import random

import anyio
import anyio.lowlevel
import pytest

from nbos.core.errors import TransportClosedError, TransportError, UnknownPeerError
from nbos.core.transport import Transport
from tests.transport.conftest import Harness, peer

pytestmark = pytest.mark.anyio

RECEIVE_TIMEOUT = 5.0


async def receive_n(transport: Transport, n: int) -> list[tuple[str, bytes]]:
    with anyio.fail_after(RECEIVE_TIMEOUT):
        return [await transport.receive() for _ in range(n)]


async def drain(transport: Transport, quiet: float = 0.3) -> list[bytes]:
    """Everything that arrives until nothing has come for ``quiet`` seconds."""
    got: list[bytes] = []
    while True:
        with anyio.move_on_after(quiet):
            got.append((await transport.receive())[1])
            continue
        return got


async def test_endpoints_implement_the_protocol(harness: Harness) -> None:
    (a,) = await harness.mesh("a")
    assert isinstance(a, Transport)
    assert a.local == "a"
    assert a.dropped == 0


async def test_three_peers_exchange_messages(harness: Harness) -> None:
    endpoints = await harness.mesh("a", "b", "c")
    for src in endpoints:
        for dst in endpoints:
            if src is not dst:
                await src.send(dst.local, f"{src.local}->{dst.local}".encode())
    for dst in endpoints:
        got = sorted(await receive_n(dst, 2))
        others = sorted(e.local for e in endpoints if e is not dst)
        assert got == [(o, f"{o}->{dst.local}".encode()) for o in others]


async def test_empty_and_binary_payloads_arrive_intact(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    payloads = [b"", bytes(range(256)), b"\x00" * 3]
    for p in payloads:
        await a.send(b.local, p)
    got = await receive_n(b, len(payloads))
    assert sorted(p for _, p in got) == sorted(payloads)


async def test_large_payload_arrives_whole(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    big = random.Random(1).randbytes(4 << 20)
    await a.send(b.local, big)
    ((src, data),) = await receive_n(b, 1)
    assert src == "a"
    assert data == big


async def test_sender_changes_after_send_do_not_reach_receiver(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    for size in (16, 1 << 20):
        buffer = bytearray(b"x" * size)
        await a.send(b.local, buffer)  # type: ignore[arg-type]  # a mutable buffer on purpose
        buffer[:] = b"y" * size
        ((_, data),) = await receive_n(b, 1)
        assert data == b"x" * size


async def test_unknown_peer_is_refused(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    with pytest.raises(UnknownPeerError) as info:
        await a.send(peer("stranger"), b"hi")
    assert info.value.peer == "stranger"
    a.remove_peer(b.local)
    with pytest.raises(UnknownPeerError):
        await a.send(b.local, b"hi")
    a.remove_peer(b.local)  # forgetting twice is harmless


async def test_bad_address_is_a_transport_error(harness: Harness) -> None:
    (a,) = await harness.mesh("a")
    with pytest.raises(TransportError):
        a.add_peer(peer("b"), "no scheme at all")
    with pytest.raises(UnknownPeerError):
        await a.send(peer("b"), b"hi")


async def test_dead_peer_does_not_block_or_fail_senders(harness: Harness) -> None:
    (a,) = await harness.mesh("a", queue_size=8)
    a.add_peer(peer("ghost"), harness.dead_address())
    with anyio.fail_after(20):  # a blocked send would wait for ever
        for _ in range(100):
            await a.send(peer("ghost"), b"anyone?")


async def test_overflow_drops_new_messages_and_counts_them(harness: Harness) -> None:
    """A receiver that does not read fills the queue; the rest is dropped and counted.

    Every message is either counted in ``dropped`` or delivered, exactly once.
    """
    a = await harness.open("a", queue_size=8)
    b = await harness.open("b", queue_size=8)
    a.add_peer(b.local, harness.address(b))
    sent = 200
    payload = b"p" * (256 << 10)  # large, so that socket buffers cannot hide the overflow
    with anyio.fail_after(20):
        for i in range(sent):
            await a.send(b.local, i.to_bytes(4, "big") + payload)
    assert a.dropped > 0
    got = await drain(b)
    assert len(got) == sent - a.dropped
    indexes = [int.from_bytes(p[:4], "big") for p in got]
    assert len(set(indexes)) == len(indexes)


async def test_cancelled_receive_loses_nothing(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    count = int(os.environ.get("NBOS_TEST_CANCEL_MESSAGES", "300"))
    rng = random.Random(3)
    got: list[int] = []

    async def sender() -> None:
        for i in range(count):
            await a.send(b.local, i.to_bytes(4, "big"))
            # Pauses make the receiver wait, so that cancellation hits waiting receives too.
            await anyio.sleep(rng.choice([0.0, 0.0, 0.0002, 0.001]))

    attempts = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender)
        with anyio.fail_after(10):
            while len(got) < count:
                attempts += 1
                # Deadlines of zero and of a few microseconds cancel receive at every stage.
                with anyio.move_on_after(rng.choice([0.0, 0.00001, 0.0001, 0.001])):
                    got.append(int.from_bytes((await b.receive())[1], "big"))
    assert attempts > count, "no receive was cancelled: the test exercised nothing"
    assert sorted(got) == list(range(count))


async def test_closed_transport_refuses_everything(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    await a.aclose()
    await a.aclose()  # idempotent
    with pytest.raises(TransportClosedError):
        await a.send(b.local, b"x")
    with pytest.raises(TransportClosedError):
        await a.receive()
    with pytest.raises(TransportClosedError):
        a.add_peer(peer("c"), harness.dead_address())


async def test_close_wakes_a_blocked_receive(harness: Harness) -> None:
    (a,) = await harness.mesh("a")
    outcome: list[BaseException] = []

    async def blocked() -> None:
        try:
            await a.receive()
        except TransportClosedError as exc:
            outcome.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await anyio.sleep(0.05)
            await a.aclose()
    assert len(outcome) == 1


async def test_restarted_peer_is_reached_again(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    address = harness.address(b)
    await b.aclose()
    b2 = await harness.reopen("b", address)
    b2.add_peer(a.local, harness.address(a))
    with anyio.fail_after(RECEIVE_TIMEOUT):
        while True:
            await a.send(b2.local, b"again")
            with anyio.move_on_after(0.1):
                assert await b2.receive() == ("a", b"again")
                break
    await b2.send(a.local, b"back")
    assert await receive_n(a, 1) == [("b", b"back")]


async def test_receiving_a_backlog_still_lets_other_tasks_run(harness: Harness) -> None:
    a, b = await harness.mesh("a", "b")
    for i in range(500):
        await a.send(b.local, i.to_bytes(2, "big"))
    await anyio.sleep(0.2)  # let the whole backlog reach b
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.lowlevel.checkpoint()
        before = turns
        await receive_n(b, 500)
        assert turns - before >= 5, "receive starved the other task"
        tg.cancel_scope.cancel()
