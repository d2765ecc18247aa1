"""MemoryNetwork specifics: seeded determinism, the pump API, partitions, faults."""

from __future__ import annotations

import anyio
import pytest

from nbos.core.errors import ConfigError, TransportError
from nbos.transport import MemoryNetwork, MemoryTransport, TraceEvent
from nbos.transport.memory import address_of
from tests.transport.conftest import connect, peer

PEERS = ("a", "b", "c")


def mesh(network: MemoryNetwork) -> dict[str, MemoryTransport]:
    endpoints = {p: network.endpoint(p) for p in PEERS}
    connect(list(endpoints.values()))
    return endpoints


def run_scenario(seed: int) -> tuple[list[tuple[str, str, bytes]], list[TraceEvent]]:
    """Sends, partial pumping, a partition and a heal; returns what arrived and the trace."""
    network = MemoryNetwork(seed, drop_rate=0.2, duplicate_rate=0.2, reorder=True, manual=True)
    endpoints = mesh(network)
    arrived: list[tuple[str, str, bytes]] = []

    def pump(steps: int) -> None:
        for _ in range(steps):
            envelope = network.deliver_one()
            if envelope is None:
                return
            while (message := endpoints[envelope.dst].receive_nowait()) is not None:
                arrived.append((envelope.dst, *message))

    for round_ in range(20):
        for src in PEERS:
            for dst in PEERS:
                if src != dst:
                    endpoints[src].send_nowait(peer(dst), f"{round_}:{src}>{dst}".encode())
        pump(4)
        if round_ == 8:
            network.partition({"a"}, {"b", "c"})
        if round_ == 14:
            network.heal()
    pump(10_000)
    return arrived, list(network.trace)


def test_same_seed_gives_the_same_run_without_an_event_loop() -> None:
    first, second = run_scenario(11), run_scenario(11)
    assert first == second
    kinds = {event.kind for event in first[1]}
    # The scenario does exercise every fault, so determinism covers them all.
    assert {"send", "drop", "duplicate", "cut", "deliver"} <= kinds


def test_another_seed_gives_another_run() -> None:
    assert run_scenario(11)[1] != run_scenario(12)[1]


def test_reorder_picks_seeded_order_and_fifo_keeps_send_order() -> None:
    def order(reorder: bool) -> list[bytes]:
        network = MemoryNetwork(5, reorder=reorder, manual=True)
        a, b = network.endpoint("a"), network.endpoint("b")
        a.add_peer(b.local, b.address)
        for i in range(30):
            a.send_nowait(b.local, bytes([i]))
        assert network.deliver_all() == 30
        return [m[1] for m in iter(b.receive_nowait, None)]

    assert order(reorder=False) == [bytes([i]) for i in range(30)]
    shuffled = order(reorder=True)
    assert sorted(shuffled) == [bytes([i]) for i in range(30)]
    assert shuffled != sorted(shuffled)


def test_explicit_deliver_and_discard() -> None:
    network = MemoryNetwork(manual=True)
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    a.send_nowait(b.local, b"one")
    a.send_nowait(b.local, b"two")
    first, second = network.in_flight
    network.discard(first)
    assert network.deliver(second)
    assert b.receive_nowait() == ("a", b"two")
    assert b.receive_nowait() is None
    with pytest.raises(ValueError, match="not in flight"):
        network.deliver(second)


def test_partition_cuts_both_ways_between_groups_only() -> None:
    network = MemoryNetwork(manual=True)
    e = mesh(network)
    network.partition({"a", "b"}, {"c"})
    for src, dst in [("a", "b"), ("a", "c"), ("c", "a"), ("c", "b"), ("b", "a")]:
        e[src].send_nowait(peer(dst), f"{src}>{dst}".encode())
    network.deliver_all()
    assert e["b"].receive_nowait() == ("a", b"a>b")
    assert e["a"].receive_nowait() == ("b", b"b>a")
    assert e["c"].receive_nowait() is None
    assert e["a"].receive_nowait() is None
    assert e["b"].receive_nowait() is None
    network.heal()
    e["c"].send_nowait(peer("a"), b"healed")
    network.deliver_all()
    assert e["a"].receive_nowait() == ("c", b"healed")


def test_one_way_cut_and_in_flight_messages_hit_by_a_cut() -> None:
    network = MemoryNetwork(manual=True)
    e = mesh(network)
    e["a"].send_nowait(peer("c"), b"sent before the cut")
    network.cut("a", "c")
    e["c"].send_nowait(peer("a"), b"other way")
    network.deliver_all()
    assert e["c"].receive_nowait() is None
    assert e["a"].receive_nowait() == ("c", b"other way")
    assert not network.link_up("a", "c")
    network.restore("a", "c")
    assert network.link_up("a", "c")
    assert [t.kind for t in network.trace if t.dst == "c"] == ["send", "cut"]


def test_overflow_is_exact_and_frees_up_as_the_receiver_reads() -> None:
    network = MemoryNetwork(manual=True, queue_size=5)
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    for _ in range(8):
        a.send_nowait(b.local, b"m")
    assert a.dropped == 3
    network.deliver_all()
    a.send_nowait(b.local, b"m")  # delivered but unread messages still count
    assert a.dropped == 4
    assert b.receive_nowait() is not None
    a.send_nowait(b.local, b"m")
    assert a.dropped == 4


def test_closed_endpoint_loses_its_messages_and_its_address_can_reopen() -> None:
    network = MemoryNetwork(manual=True)
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    a.send_nowait(b.local, b"lost")
    anyio.run(b.aclose)
    assert network.in_flight == ()
    with pytest.raises(TransportError, match="in use"):
        network.endpoint("a")
    b2 = network.endpoint("b")
    a.send_nowait(b.local, b"found")
    network.deliver_all()
    assert b2.receive_nowait() == ("a", b"found")


def test_bad_settings_and_addresses_are_typed_errors() -> None:
    with pytest.raises(ConfigError):
        MemoryNetwork(drop_rate=1.5)
    with pytest.raises(ConfigError):
        MemoryNetwork(delay=(0.2, 0.1))
    with pytest.raises(ConfigError):
        MemoryNetwork(queue_size=0)
    network = MemoryNetwork()
    with pytest.raises(ConfigError):
        network.endpoint("a", queue_size=0)
    with pytest.raises(TransportError):
        network.endpoint("b").add_peer(peer("x"), "mem://")
    assert address_of("x") == "mem://x"


@pytest.mark.anyio
async def test_auto_mode_drops_and_duplicates_at_the_configured_rates() -> None:
    network = MemoryNetwork(3, drop_rate=0.5, duplicate_rate=1.0)
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    for i in range(200):
        await a.send(b.local, i.to_bytes(2, "big"))
    got: list[int] = []
    while (message := b.receive_nowait()) is not None:
        got.append(int.from_bytes(message[1], "big"))
    survivors = set(got)
    assert sorted(got) == sorted(list(survivors) * 2)  # every survivor arrives twice
    assert 60 < len(survivors) < 140
    assert a.dropped == 0  # network losses are not overflow


@pytest.mark.anyio
async def test_auto_mode_delays_reorder_and_wait_in_real_time() -> None:
    network = MemoryNetwork(9, delay=(0.02, 0.06))
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    start = anyio.current_time()
    for i in range(20):
        await a.send(b.local, bytes([i]))
    assert b.receive_nowait() is None
    with anyio.fail_after(20):
        got = [(await b.receive())[1] for _ in range(20)]
    assert anyio.current_time() - start >= 0.02
    assert sorted(got) == [bytes([i]) for i in range(20)]
    assert got != sorted(got)


@pytest.mark.anyio
async def test_auto_mode_partition_applies_to_delayed_messages() -> None:
    network = MemoryNetwork(9, delay=(0.05, 0.05))
    a, b = network.endpoint("a"), network.endpoint("b")
    a.add_peer(b.local, b.address)
    await a.send(b.local, b"delayed")
    network.partition({"a"}, {"b"})
    with anyio.move_on_after(0.2) as scope:
        await b.receive()
    assert scope.cancelled_caught
    network.heal()
    await a.send(b.local, b"after heal")
    with anyio.fail_after(20):
        assert await b.receive() == ("a", b"after heal")
