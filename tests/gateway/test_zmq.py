"""Scheduler and agents over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import anyio.abc
import pytest

from nbos.agent import HostAgent
from nbos.core.ids import HostId, KernelId
from nbos.gateway import GpuScheduler
from nbos.gpu import GpuPool, discover_gpus
from nbos.transport import ZmqTransport

pytestmark = pytest.mark.anyio

ALL = {0: HostId("h0"), 1: HostId("h1"), 2: HostId("h2")}


@asynccontextmanager
async def zmq_agent(host: str, gateway: ZmqTransport) -> AsyncIterator[HostAgent]:
    inventory = discover_gpus(virtual_count=2, mode="virtual")
    pool = GpuPool(inventory.indices, time.monotonic, 30.0)
    async with (
        await ZmqTransport.open(f"{host}/agent") as endpoint,
        HostAgent.serve(
            host,
            endpoint,
            pool,
            gateway=gateway.local,
            gateway_address=gateway.address,
            heartbeat_interval=0.05,
        ) as agent,
    ):
        yield agent


async def test_contention_and_agent_restart_over_zmq() -> None:
    async with (
        await ZmqTransport.open("gateway") as gateway,
        GpuScheduler.serve(
            gateway, rpc_timeout=1.0, retry_interval=0.1, host_timeout=2.0, poll_interval=0.1
        ) as scheduler,
        AsyncExitStack() as stack,
    ):
        for host in ("h1", "h2"):
            await stack.enter_async_context(zmq_agent(host, gateway))
        h0 = AsyncExitStack()
        await h0.enter_async_context(zmq_agent("h0", gateway))
        await scheduler.wait_for_hosts(3, timeout=5)

        a = await scheduler.acquire(KernelId("a"), 1, ALL, last_executor=0, gpus=2)
        b = await scheduler.acquire(KernelId("b"), 1, ALL, last_executor=0, gpus=2)
        assert a.host == "h0"
        assert b.host in ("h1", "h2")
        a = await scheduler.committed(a)

        # The agent of h0 restarts on a new port with an empty pool.
        await h0.aclose()
        restarted = await h0.enter_async_context(zmq_agent("h0", gateway))
        with anyio.fail_after(20):
            while not restarted.pool.committed():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert restarted.pool.committed()[0].reservation_id == a.reservation_id
        await scheduler.release(a)
        await scheduler.release(b)
        assert restarted.pool.counts().idle == 2
        await h0.aclose()
