"""The front's socket to one replica's IOPub, read without pyzmq's asyncio layer."""

from __future__ import annotations

import anyio
import pytest
import zmq
import zmq.asyncio

from nbos.kernel.front._upstream import ReplicaEndpoint, Upstream
from nbos.transport.ports import free_loopback_ports

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_every_published_message_is_received_in_order_across_bursts_and_pauses() -> None:
    iopub, shell, control, stdin = free_loopback_ports(4)
    connection = {
        "ip": "127.0.0.1",
        "iopub_port": iopub,
        "shell_port": shell,
        "control_port": control,
        "stdin_port": stdin,
        "key": "k",
    }
    ctx = zmq.asyncio.Context()
    publisher = ctx.socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{iopub}")
    up = Upstream(ReplicaEndpoint(1, connection), ctx)
    try:
        with anyio.fail_after(30):
            # The subscription reaches the publisher some time after the connect: until
            # a hello gets through, publish another.
            while not await _hello(publisher, up):
                pass
            sent = 0
            for burst in (1, 50, 1, 300, 2):
                for _ in range(burst):
                    await publisher.send_multipart([b"topic", str(sent).encode()])
                    sent += 1
                await anyio.sleep(0.05)  # the reader waits on the descriptor meanwhile
            received = [int((await up.receive_iopub())[1]) for _ in range(sent)]
        assert received == list(range(sent))
    finally:
        up.close()
        publisher.close(0)
        ctx.term()


async def _hello(publisher: zmq.asyncio.Socket, up: Upstream) -> bool:
    """Publish a hello; whether it arrived (then no other is left in the queue)."""
    await publisher.send_multipart([b"hello"])
    arrived = False
    while True:
        with anyio.move_on_after(0.2):
            assert await up.receive_iopub() == [b"hello"]
            arrived = True
            continue
        return arrived
