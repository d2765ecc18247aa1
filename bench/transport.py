"""nbos's transports vs raw pyzmq on loopback: round-trip latency and echo throughput.

Each mode runs an echo server in its own process (its own event loop) and a
client here, so both sides of every mode pay the same costs:

* ``nbos``: two ZmqTransport endpoints (ROUTER in, DEALER per peer out).
* ``nbos-tcp``: two TcpTransport endpoints (what a kernel's Raft group uses without
  keys): no ZeroMQ, so no I/O thread to wake on either end.
* ``raw-asyncio`` (the anchor): a zmq.asyncio DEALER against a zmq.asyncio
  ROUTER that echoes, the plain pyzmq way to do this under asyncio.
* ``raw-reader``: nbos's socket topology and wake-up scheme written inline on
  raw sockets: what the nbos layer itself costs is the gap to it.
* ``raw-sync``: the same with blocking sockets and no event loop, for reference
  (a floor no asyncio library reaches).

Latency: one message in flight; ``NBOS_BENCH_ROUNDS`` blocks of ``NBOS_BENCH_BLOCK``
round trips per mode, the modes alternating block by block so that load from
other processes on the machine hits them alike. Throughput: ``NBOS_BENCH_WINDOW``
messages in flight, ``NBOS_BENCH_STREAM`` echoes, median of three runs per mode.
The last line is the JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import cast

import zmq
import zmq.asyncio

from nbos.core.ids import PeerId
from nbos.transport import TcpTransport, ZmqTransport

BLOCK = int(os.environ.get("NBOS_BENCH_BLOCK", "250"))
STREAM = int(os.environ.get("NBOS_BENCH_STREAM", "20000"))
WINDOW = int(os.environ.get("NBOS_BENCH_WINDOW", "64"))
ROUNDS = int(os.environ.get("NBOS_BENCH_ROUNDS", "40"))
WARMUP = 500
PAYLOAD = b"x" * 64
TRANSPORTS: dict[str, type[ZmqTransport | TcpTransport]] = {
    "nbos": ZmqTransport,
    "nbos-tcp": TcpTransport,
}
MODES = ("nbos", "nbos-tcp", "raw-asyncio", "raw-reader", "raw-sync")

# --- servers (run in a child process) ---------------------------------------------


async def serve_nbos(kind: type[ZmqTransport | TcpTransport], client_address: str) -> None:
    async with await kind.open("server") as transport:
        transport.add_peer(PeerId("client"), client_address)
        print(transport.address, flush=True)
        while True:
            sender, payload = await transport.receive()
            await transport.send(sender, payload)


async def serve_raw_asyncio() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        await router.send_multipart(await router.recv_multipart())


class LoopReader:
    """A raw socket read through one long-lived asyncio reader: the asyncio floor."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None
        self.fd = cast(int, sock.getsockopt(zmq.FD))
        self.loop.add_reader(self.fd, self.wake)

    def wake(self) -> None:
        if self.has_input() and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def has_input(self) -> bool:
        return bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    async def recv_multipart(self) -> list[bytes]:
        while not self.has_input():
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.sock.recv_multipart(zmq.NOBLOCK)


def reader_pair(
    ctx: zmq.Context[zmq.Socket[bytes]], peer_address: str
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """nbos's topology without nbos: a bound ROUTER to read, a DEALER to the peer to send."""
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"raw")
    if peer_address != "-":
        dealer.connect(peer_address)
    return router, dealer


async def serve_raw_reader(client_address: str) -> None:
    router, dealer = reader_pair(zmq.Context(), client_address)
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    reader = LoopReader(router)
    while True:
        dealer.send((await reader.recv_multipart())[1], zmq.NOBLOCK)


def serve_raw_sync() -> None:
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        router.send_multipart(router.recv_multipart())


def serve(mode: str, client_address: str) -> None:
    if mode in ("nbos", "nbos-tcp"):
        asyncio.run(serve_nbos(TRANSPORTS[mode], client_address))
    elif mode == "raw-asyncio":
        asyncio.run(serve_raw_asyncio())
    elif mode == "raw-reader":
        asyncio.run(serve_raw_reader(client_address))
    else:
        serve_raw_sync()


def start_server(stack: AsyncExitStack, mode: str, client_address: str = "-") -> str:
    """Start an echo server process (killed by pid when ``stack`` closes); its address."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", mode, client_address], stdout=subprocess.PIPE
    )
    stack.callback(proc.wait)
    stack.callback(proc.kill)
    assert proc.stdout is not None
    return proc.stdout.readline().decode().strip()


# --- clients ----------------------------------------------------------------------


class Client:
    """One mode's client side: a round trip and a windowed echo stream."""

    def __init__(self, send: Callable[[], Awaitable[None]], recv: Callable[[], Awaitable[object]]):
        self.send = send
        self.recv = recv

    async def pings(self, count: int) -> list[int]:
        samples = []
        clock = time.perf_counter_ns
        send, recv = self.send, self.recv
        for _ in range(count):
            start = clock()
            await send()
            await recv()
            samples.append(clock() - start)
        return samples

    async def stream(self) -> float:
        start = time.perf_counter()
        for _ in range(WINDOW):
            await self.send()
        for _ in range(STREAM - WINDOW):
            await self.recv()
            await self.send()
        for _ in range(WINDOW):
            await self.recv()
        return STREAM / (time.perf_counter() - start)


async def open_nbos(stack: AsyncExitStack, mode: str = "nbos") -> Client:
    transport = await stack.enter_async_context(await TRANSPORTS[mode].open("client"))
    address = start_server(stack, mode, transport.address)
    server = PeerId("server")
    transport.add_peer(server, address)

    async def send() -> None:
        await transport.send(server, PAYLOAD)

    return Client(send, transport.receive)


async def open_raw_asyncio(stack: AsyncExitStack) -> Client:
    ctx = zmq.asyncio.Context()
    stack.callback(ctx.destroy, linger=0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(start_server(stack, "raw-asyncio"))

    async def send() -> None:
        await dealer.send(PAYLOAD)

    return Client(send, dealer.recv)


async def open_raw_reader(stack: AsyncExitStack) -> Client:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stack.callback(ctx.destroy, linger=0)
    router, dealer = reader_pair(ctx, "-")
    dealer.connect(start_server(stack, "raw-reader", router.getsockopt_string(zmq.LAST_ENDPOINT)))
    reader = LoopReader(router)
    stack.callback(reader.loop.remove_reader, reader.fd)

    async def send() -> None:
        dealer.send(PAYLOAD, zmq.NOBLOCK)

    return Client(send, reader.recv_multipart)


async def open_raw_sync(stack: AsyncExitStack) -> Client:
    ctx = zmq.Context()
    stack.callback(ctx.destroy, linger=0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(start_server(stack, "raw-sync"))

    # Blocking calls in coroutines: nothing else runs on this loop meanwhile.
    async def send() -> None:
        dealer.send(PAYLOAD)

    async def recv() -> bytes:
        return dealer.recv()

    return Client(send, recv)


async def open_nbos_tcp(stack: AsyncExitStack) -> Client:
    return await open_nbos(stack, "nbos-tcp")


OPENERS = {
    "nbos": open_nbos,
    "nbos-tcp": open_nbos_tcp,
    "raw-asyncio": open_raw_asyncio,
    "raw-reader": open_raw_reader,
    "raw-sync": open_raw_sync,
}


async def measure() -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    samples: dict[str, list[int]] = {m: [] for m in MODES}
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    async with AsyncExitStack() as stack:
        clients = {mode: await OPENERS[mode](stack) for mode in MODES}
        for client in clients.values():
            await client.pings(WARMUP)
        # Small alternating blocks, so that load from other processes hits every mode alike.
        for _ in range(ROUNDS):
            for mode, client in clients.items():
                samples[mode].extend(await client.pings(BLOCK))
        for _ in range(3):
            for mode, client in clients.items():
                rates[mode].append(await client.stream())
    return samples, rates


def percentile(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def main() -> None:
    samples, rates = asyncio.run(measure())
    print(f"loopback, {len(PAYLOAD)}-byte payload, {ROUNDS} blocks x {BLOCK} pings per mode")
    print(f"{'mode':<12} {'p50 us':>8} {'p99 us':>8} {'echo msg/s':>11}")
    p50 = {}
    for mode in MODES:
        p50[mode] = percentile(samples[mode], 0.50)
        p99 = percentile(samples[mode], 0.99)
        print(f"{mode:<12} {p50[mode]:8.1f} {p99:8.1f} {statistics.median(rates[mode]):11.0f}")
    ratio = p50["nbos"] / p50["raw-asyncio"]
    others = ", ".join(f"{m}: {p50['nbos'] / p50[m]:.2f}x" for m in MODES[1:])
    print(f"p50 of nbos over {others}")
    summary = {
        "bench": "transport",
        "metric": "p50 round-trip latency, 64 B, loopback",
        "unit": "us",
        "value": round(p50["nbos"], 2),
        "anchor": "raw pyzmq zmq.asyncio DEALER/ROUTER ping-pong",
        "anchor_value": round(p50["raw-asyncio"], 2),
        "ratio": round(ratio, 3),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        main()
