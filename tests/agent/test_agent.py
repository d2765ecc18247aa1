"""The host agent's protocol, spoken by hand from a gateway endpoint on the in-memory network."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import attrs
import pytest

from nbos.agent import EvictHook, HostAgent
from nbos.core.errors import ConfigError
from nbos.core.ids import KernelId, PeerId
from nbos.core.wire import encode
from nbos.core.wire.agent import (
    AgentReply,
    AgentRequest,
    AgentRestore,
    AgentStatus,
    AgentStatusRequest,
    GpuCommit,
    GpuEvicted,
    GpuFreed,
    GpuGranted,
    GpuPrecommit,
    GpuRefused,
    GpuRelease,
    GpuReleaseKernel,
    GpuReservation,
)
from nbos.core.wire.codec import decode
from nbos.gpu import GpuPool
from nbos.transport import MemoryNetwork, MemoryTransport

pytestmark = pytest.mark.anyio

AGENT = PeerId("h0/agent")


@attrs.define
class Gateway:
    """The gateway's side of the conversation, by hand."""

    endpoint: MemoryTransport
    agent: HostAgent
    statuses: list[AgentStatus] = attrs.Factory(list)

    async def ask(self, request: AgentRequest) -> AgentReply:
        await self.endpoint.send(AGENT, encode(request))
        return await self.reply_to(request.request_id)

    async def reply_to(self, request_id: int) -> AgentReply:
        with anyio.fail_after(20):
            while True:
                _, data = await self.endpoint.receive()
                message = decode(data)
                assert isinstance(message, GpuGranted | GpuRefused | GpuFreed | AgentStatus)
                if message.request_id == request_id:
                    return message
                if isinstance(message, AgentStatus):
                    self.statuses.append(message)

    async def next_status(self) -> AgentStatus:
        with anyio.fail_after(20):
            while True:
                _, data = await self.endpoint.receive()
                message = decode(data)
                if isinstance(message, AgentStatus) and message.request_id is None:
                    return message


@asynccontextmanager
async def agent(
    devices: Sequence[int] = (0, 1, 2, 3),
    *,
    ttl: float = 30.0,
    on_evict: EvictHook | None = None,
    evict_timeout: float = 1.0,
    network: MemoryNetwork | None = None,
) -> AsyncIterator[Gateway]:
    net = network or MemoryNetwork(seed=3)
    gateway = net.endpoint("gateway")
    endpoint = net.endpoint(AGENT)
    gateway.add_peer(AGENT, endpoint.address)
    pool = GpuPool(devices, time.monotonic, ttl)
    async with HostAgent.serve(
        "h0",
        endpoint,
        pool,
        gateway="gateway",
        gateway_address=gateway.address,
        on_evict=on_evict,
        evict_timeout=evict_timeout,
        heartbeat_interval=0.05,
    ) as a:
        yield Gateway(gateway, a)
    await endpoint.aclose()
    await gateway.aclose()


def granted(reply: AgentReply) -> GpuReservation:
    assert isinstance(reply, GpuGranted), reply
    return reply.reservation


async def test_announces_itself_on_start() -> None:
    async with agent() as gw:
        status = await gw.next_status()
        assert (status.host_id, status.devices, status.reservations) == ("h0", [0, 1, 2, 3], [])
        assert status.incarnation == gw.agent.incarnation
        assert status.address == "mem://h0/agent"


async def test_precommit_commit_release_are_idempotent() -> None:
    async with agent() as gw:
        first = granted(await gw.ask(GpuPrecommit(1, "r1", "k", 2)))
        assert (first.state, first.devices) == ("precommitted", [0, 1])
        again = granted(await gw.ask(GpuPrecommit(2, "r1", "k", 2)))
        assert again.devices == first.devices
        assert gw.agent.pool.counts().precommitted == 2
        for request_id in (3, 4):
            committed = granted(await gw.ask(GpuCommit(request_id, "r1", "k", 2)))
            assert (committed.state, committed.devices) == ("committed", [0, 1])
        for request_id in (5, 6):
            freed = await gw.ask(GpuRelease(request_id, "r1"))
            assert freed == GpuFreed(request_id, ["r1"], [0, 1])
        assert gw.agent.pool.counts().idle == 4


async def test_refusals_are_typed_answers() -> None:
    async with agent(devices=(0, 1)) as gw:
        granted(await gw.ask(GpuPrecommit(1, "r1", "k", 2)))
        refused = await gw.ask(GpuPrecommit(2, "r2", "j", 1))
        assert isinstance(refused, GpuRefused)
        assert (refused.reason, refused.idle) == ("insufficient", 0)
        refused = await gw.ask(GpuPrecommit(3, "r1", "other-kernel", 2))
        assert isinstance(refused, GpuRefused) and refused.reason == "invalid"
        refused = await gw.ask(GpuPrecommit(4, "r3", "k", -1))
        assert isinstance(refused, GpuRefused) and refused.reason == "invalid"
        assert gw.agent.pool.counts().precommitted == 2


async def test_garbage_and_strangers_are_dropped_and_the_agent_goes_on() -> None:
    net = MemoryNetwork(seed=5)
    async with agent(network=net) as gw:
        await gw.endpoint.send(AGENT, b"\x93not a message")
        stranger = net.endpoint("stranger")
        stranger.add_peer(AGENT, "mem://h0/agent")
        await stranger.send(AGENT, encode(GpuPrecommit(1, "evil", "k", 4)))
        reply = await gw.ask(AgentStatusRequest(2))
        assert isinstance(reply, AgentStatus)
        assert reply.reservations == []
        assert stranger.receive_nowait() is None
        await stranger.aclose()


async def test_unclaimed_precommit_expires_and_is_reported() -> None:
    async with agent(ttl=0.2) as gw:
        granted(await gw.ask(GpuPrecommit(1, "r1", "k", 1)))
        with anyio.fail_after(20):
            while (await gw.next_status()).reservations:
                pass
        assert gw.agent.pool.counts().idle == 4
        lookup = gw.agent.pool.lookup("r1")
        assert lookup is not None and lookup.state == "expired"
        refused = await gw.ask(GpuRelease(2, "r1"))
        assert refused == GpuFreed(2, ["r1"], [0])


async def test_eviction_hook_runs_once_before_the_grant() -> None:
    calls: list[tuple[KernelId, tuple[int, ...]]] = []
    called, gate = anyio.Event(), anyio.Event()

    async def on_evict(kernel: KernelId, devices: tuple[int, ...]) -> None:
        calls.append((kernel, devices))
        called.set()
        await gate.wait()

    async with agent(devices=(0, 1), on_evict=on_evict) as gw:
        granted(await gw.ask(GpuCommit(1, "a1", "a", 2)))
        await gw.ask(GpuRelease(2, "a1", resident=True))
        assert gw.agent.pool.resident() == {0: "a", 1: "a"}
        # Two copies of the same request while the eviction is under way.
        await gw.endpoint.send(AGENT, encode(GpuPrecommit(3, "b1", "b", 1)))
        await gw.endpoint.send(AGENT, encode(GpuPrecommit(4, "b1", "b", 1)))
        with anyio.fail_after(20):
            await called.wait()
        gate.set()
        first = granted(await gw.reply_to(3))
        second = granted(await gw.reply_to(4))
        assert first.evict_from == [(0, "a")] == second.evict_from
        assert calls == [(KernelId("a"), (0,))]
        assert gw.agent.pool.resident() == {}


async def test_failed_eviction_refuses_and_frees_the_devices() -> None:
    async def hung(kernel: KernelId, devices: tuple[int, ...]) -> None:
        await anyio.sleep_forever()

    async with agent(devices=(0,), on_evict=hung, evict_timeout=0.05) as gw:
        granted(await gw.ask(GpuCommit(1, "a1", "a", 1)))
        await gw.ask(GpuRelease(2, "a1", resident=True))
        refused = await gw.ask(GpuPrecommit(3, "b1", "b", 1))
        assert isinstance(refused, GpuRefused) and refused.reason == "evict_failed"
        assert gw.agent.pool.counts().idle == 1


async def test_release_kernel_evicted_and_status() -> None:
    async with agent() as gw:
        granted(await gw.ask(GpuCommit(1, "a1", "a", 1)))
        granted(await gw.ask(GpuPrecommit(2, "a2", "a", 2)))
        granted(await gw.ask(GpuCommit(3, "b1", "b", 1)))
        await gw.ask(GpuRelease(4, "b1", resident=True))
        freed = await gw.ask(GpuReleaseKernel(5, "a"))
        assert freed == GpuFreed(5, ["a1", "a2"], [0, 1, 2])
        status = await gw.ask(AgentStatusRequest(6))
        assert isinstance(status, AgentStatus)
        assert status.reservations == [] and status.resident == [(3, "b")]
        assert await gw.ask(GpuEvicted(7, "b")) == GpuFreed(7)
        assert gw.agent.pool.resident() == {}


async def test_restore_takes_back_committed_reservations_and_refuses_conflicts() -> None:
    async with agent() as gw:
        granted(await gw.ask(GpuCommit(1, "mine", "k", 1)))
        granted(await gw.ask(GpuPrecommit(2, "pending", "k", 1)))
        lost = GpuReservation("lost", "j", [2, 3], "committed")
        assert await gw.ask(AgentRestore(3, [lost])) == GpuFreed(3, ["lost"])
        pool = gw.agent.pool
        assert {a.reservation_id for a in pool.committed()} == {"mine", "lost"}
        assert {a.reservation_id for a in pool.reservations()} == {"mine", "lost", "pending"}
        clash = GpuReservation("clash", "x", [0], "committed")
        refused = await gw.ask(AgentRestore(4, [clash]))
        assert isinstance(refused, GpuRefused) and refused.reason == "invalid"
        assert gw.agent.pool is pool


async def test_bad_settings_are_config_errors() -> None:
    net = MemoryNetwork()
    endpoint = net.endpoint("a")
    pool = GpuPool((0,), time.monotonic, 1.0)
    with pytest.raises(ConfigError):
        async with HostAgent.serve(
            "h", endpoint, pool, gateway="g", gateway_address="mem://g", heartbeat_interval=0
        ):
            pass
    with pytest.raises(ConfigError):
        async with HostAgent.serve(
            "h", endpoint, pool, gateway="g", gateway_address="mem://g", address=""
        ):
            pass
