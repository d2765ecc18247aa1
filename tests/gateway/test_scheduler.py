"""The GPU scheduler with real host agents over the in-memory network (virtual GPUs)."""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from nbos.core.errors import GpuError, InsufficientGpusError, QuorumLostError
from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.wire import encode
from nbos.core.wire.agent import GpuFreed, GpuPrecommit
from nbos.gateway import Grant
from nbos.gpu import GpuPool
from tests._wait import eventually
from tests.gateway._cluster import Cluster, cluster, kernel, replicas

pytestmark = pytest.mark.anyio

THREE = {"h0": (0, 1), "h1": (0, 1), "h2": (0, 1)}
ALL = replicas("h0", "h1", "h2")


def held(c: Cluster) -> dict[str, int]:
    """Devices pre-committed or committed on each agent's pool."""
    return {h: a.pool.counts().total - a.pool.counts().idle for h, a in c.agents.items()}


async def test_placement_uses_three_distinct_hosts_and_subscribes() -> None:
    async with cluster({"h0": (0, 1), "h1": (0, 1), "h2": (0, 1), "h3": (0, 1)}) as c:
        hosts = c.scheduler.place(kernel("a"), 1)
        assert len(set(hosts)) == 3
        view = {h.host_id: h for h in c.scheduler.view().hosts}
        assert sum(view[h].gpus_subscribed for h in view) == 3
        assert all(view[h].replicas == 1 for h in hosts)


def subscribed(c: Cluster) -> dict[str, tuple[int, int]]:
    """GPUs subscribed and replicas placed per host, as the scheduler's view says."""
    return {h.host_id: (h.gpus_subscribed, h.replicas) for h in c.scheduler.view().hosts}


async def test_subscriptions_follow_placements_moves_and_kernels_gone() -> None:
    async with cluster({"h0": (0, 1), "h1": (0, 1), "h2": (0, 1), "h3": (0, 1)}) as c:
        hosts = ("h0", "h1", "h2")
        c.scheduler.adopt_placement(kernel("a"), [HostId(h) for h in hosts], 2)
        c.scheduler.adopt_placement(kernel("b"), [HostId(h) for h in ("h1", "h2", "h3")], 1)
        assert subscribed(c) == {"h0": (2, 1), "h1": (3, 2), "h2": (3, 2), "h3": (1, 1)}
        c.scheduler.replica_moved(kernel("a"), HostId("h0"), HostId("h3"))
        assert subscribed(c) == {"h0": (0, 0), "h1": (3, 2), "h2": (3, 2), "h3": (3, 2)}
        # Adopted again (a gateway taking the kernel over): the placement is replaced.
        c.scheduler.adopt_placement(kernel("b"), [HostId(h) for h in ("h0", "h1", "h2")], 1)
        assert subscribed(c) == {"h0": (1, 1), "h1": (3, 2), "h2": (3, 2), "h3": (2, 1)}
        await c.scheduler.kernel_gone(kernel("a"))
        assert subscribed(c) == {"h0": (1, 1), "h1": (1, 1), "h2": (1, 1), "h3": (0, 0)}


async def test_two_kernels_contend_second_runs_on_another_replicas_host() -> None:
    async with cluster(THREE) as c:
        a = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=2)
        assert (a.replica, a.host, a.devices) == (0, "h0", (0, 1))
        # b's last executor is also on h0, whose GPUs a holds: b goes to the most idle replica host.
        b = await c.scheduler.acquire(kernel("b"), 1, ALL, last_executor=0, gpus=2)
        assert b.host != "h0"
        assert b.replica == {"h1": 1, "h2": 2}[b.host]
        assert held(c) == {
            "h0": 2,
            "h1": 2 if b.host == "h1" else 0,
            "h2": 2 if b.host == "h2" else 0,
        }
        await c.scheduler.committed(a)
        assert c.pool("h0").committed()[0].reservation_id == a.reservation_id
        await c.scheduler.release(a, resident=True)
        await c.scheduler.release(b)
        assert held(c) == {"h0": 0, "h1": 0, "h2": 0}
        assert c.pool("h0").resident() == {0: "a", 1: "a"}


async def test_last_executor_kept_when_its_host_has_room() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=2, gpus=1)
        assert (g.replica, g.host) == (2, "h2")


async def test_more_gpus_than_any_host_fails_at_once() -> None:
    async with cluster(THREE) as c:
        with anyio.fail_after(20), pytest.raises(InsufficientGpusError) as info:
            await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=None, gpus=3)
        assert (info.value.requested, info.value.available) == (3, 2)
        assert "no host has that many" in str(info.value)
        with pytest.raises(GpuError):
            await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=None, gpus=-1)
        with pytest.raises(QuorumLostError):
            await c.scheduler.acquire(kernel("a"), 1, {}, last_executor=None, gpus=1)


async def test_zero_gpus_needs_no_reservation() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=1, gpus=0)
        assert (g.replica, g.devices, g.reservation_id) == (1, (), "")
        assert await c.scheduler.committed(g) == g
        await c.scheduler.release(g)
        assert held(c) == {"h0": 0, "h1": 0, "h2": 0}


async def test_waiting_cell_is_woken_in_fifo_order_when_gpus_are_released() -> None:
    async with cluster({"h0": (0,), "h1": (0,), "h2": (0,)}) as c:
        holders = [
            await c.scheduler.acquire(kernel(f"k{i}"), 1, ALL, last_executor=i, gpus=1)
            for i in range(3)
        ]
        got: dict[str, Grant] = {}
        reasons: list[str] = []

        async def on_wait(reason: str) -> None:
            reasons.append(reason)

        async def wait_for(name: str) -> None:
            got[name] = await c.scheduler.acquire(
                kernel(name), 1, ALL, last_executor=None, gpus=1, on_wait=on_wait
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for, "first")
            await eventually(lambda: (kernel("first"), 1) in c.scheduler.waiting())
            tg.start_soon(wait_for, "second")
            await eventually(lambda: (kernel("second"), 1) in c.scheduler.waiting())
            assert "waiting for 1 GPUs" in reasons[0]
            assert not got
            await c.scheduler.release(holders[1])
            await eventually(lambda: "first" in got)
            assert got["first"].host == "h1"
            assert "second" not in got
            await c.scheduler.release(holders[2])
            await eventually(lambda: "second" in got)
        assert got["second"].host == "h2"
        assert c.scheduler.waiting() == {}


async def test_cell_releases_on_success_error_cancel_and_timeout() -> None:
    async with cluster(THREE) as c:
        s = c.scheduler
        async with s.cell(kernel("a"), 1, ALL, last_executor=0, gpus=2) as lease:
            await lease.committed()
            assert held(c)["h0"] == 2
        assert held(c)["h0"] == 0
        assert c.pool("h0").resident() == {0: "a", 1: "a"}

        with pytest.raises(RuntimeError, match="cell failed"):
            async with s.cell(kernel("a"), 2, ALL, last_executor=0, gpus=2) as lease:
                await lease.committed()
                lease.resident = False
                raise RuntimeError("cell failed")
        assert held(c)["h0"] == 0
        assert c.pool("h0").resident() == {}

        started = anyio.Event()

        async def hold_forever() -> None:
            async with s.cell(kernel("b"), 1, ALL, last_executor=1, gpus=2) as lease:
                await lease.committed()
                started.set()
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_forever)
            await started.wait()
            assert held(c)["h1"] == 2
            tg.cancel_scope.cancel()
        assert held(c)["h1"] == 0

        with anyio.move_on_after(0.1) as timeout:
            async with s.cell(kernel("b"), 2, ALL, last_executor=2, gpus=1) as lease:
                await lease.committed()
                await anyio.sleep_forever()
        assert timeout.cancelled_caught
        assert held(c) == {"h0": 0, "h1": 0, "h2": 0}
        assert s.grants() == ()


async def test_cancelled_waiter_leaves_the_queue() -> None:
    async with cluster({"h0": (0,), "h1": (0,), "h2": (0,)}) as c:
        for i in range(3):
            await c.scheduler.acquire(kernel(f"k{i}"), 1, ALL, last_executor=i, gpus=1)
        with anyio.move_on_after(0.2):
            await c.scheduler.acquire(kernel("w"), 1, ALL, last_executor=None, gpus=1)
        assert c.scheduler.waiting() == {}
        assert held(c) == {"h0": 1, "h1": 1, "h2": 1}


async def test_unclaimed_precommit_expires_and_a_late_commit_takes_fresh_devices() -> None:
    async with cluster({"h0": (0, 1), "h1": (0, 1), "h2": (0, 1)}, ttl=0.2) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        assert held(c)["h0"] == 1
        await eventually(lambda: held(c)["h0"] == 0)
        lookup = c.pool("h0").lookup(g.reservation_id)
        assert lookup is not None and lookup.state == "expired"
        # The scheduler hears of the expiry through the agent's status report.
        await eventually(lambda: g.reservation_id not in c.scheduler.host(HostId("h0")).reported)
        committed = await c.scheduler.committed(g)
        assert len(committed.devices) == 1
        assert c.pool("h0").committed()[0].reservation_id == g.reservation_id
        await c.scheduler.release(committed)
        assert held(c)["h0"] == 0


async def test_agent_restart_gets_back_its_committed_reservations() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        await c.scheduler.committed(g)
        old = c.agents["h0"].incarnation
        await c.stop_agent("h0")
        # A new agent process on a new endpoint, same host id, that lost everything.
        agent = await c.start_agent("h0", (0, 1))
        assert agent.incarnation != old
        await eventually(
            lambda: [a.reservation_id for a in c.pool("h0").committed()] == [g.reservation_id]
        )
        assert c.pool("h0").committed()[0].devices == g.devices
        # A second cell on h0 gets the other device, not the restored one.
        other = await c.scheduler.acquire(kernel("b"), 1, replicas("h0"), last_executor=0, gpus=1)
        assert set(other.devices).isdisjoint(g.devices)
        await c.scheduler.release(g)
        await c.scheduler.release(other)
        assert held(c)["h0"] == 0


async def test_restarted_agent_that_kept_its_pool_is_taken_as_reported() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=1, gpus=2)
        await c.scheduler.committed(g)
        kept = c.pool("h1").committed()
        await c.stop_agent("h1")
        pool = GpuPool.restore((0, 1), time.monotonic, 30.0, kept)
        await c.start_agent("h1", (0, 1), pool=pool)
        await eventually(
            lambda: c.scheduler.host(HostId("h1")).incarnation == c.agents["h1"].incarnation
        )
        view = {h.host_id: h for h in c.scheduler.view().hosts}
        assert view[HostId("h1")].gpus_committed == 2
        await c.scheduler.release(g)
        assert held(c)["h1"] == 0


async def test_a_silent_agent_is_suspected_and_the_cell_goes_elsewhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with cluster(THREE) as c:
        c.network.partition(["gateway"], ["h0/agent"])
        with caplog.at_level(logging.WARNING, logger="nbos.gateway"):
            g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        assert g.host in ("h1", "h2")
        assert "host h0 is suspected" in caplog.text
        assert c.scheduler.host(HostId("h0")).suspected
        assert not next(h for h in c.scheduler.view().hosts if h.host_id == "h0").schedulable
        # h0's agent never got a lasting reservation: its pre-commit attempts were lost.
        assert held(c)["h0"] == 0
        c.network.heal()
        await eventually(lambda: not c.scheduler.host(HostId("h0")).suspected)
        await c.scheduler.release(g)


async def test_release_to_a_suspected_agent_is_resent_when_it_reports_again() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=2)
        await c.scheduler.committed(g)
        c.network.partition(["gateway"], ["h0/agent"])
        with anyio.fail_after(20):  # it must not wait for the agent to come back
            await c.scheduler.release(g)
        assert held(c)["h0"] == 2
        c.network.heal()
        await eventually(lambda: held(c)["h0"] == 0)


async def test_kernel_gone_frees_everything_of_the_kernel() -> None:
    async with cluster(THREE) as c:
        c.scheduler.place(kernel("a"), 1)
        g1 = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        g2 = await c.scheduler.acquire(kernel("a"), 2, ALL, last_executor=1, gpus=2)
        other = await c.scheduler.acquire(kernel("b"), 1, ALL, last_executor=2, gpus=1)
        await c.scheduler.committed(g2)
        await c.scheduler.release(g1, resident=True)
        await c.scheduler.kernel_gone(kernel("a"))
        assert held(c) == {"h0": 0, "h1": 0, "h2": 1}
        assert c.pool("h0").resident() == {}
        assert [g.reservation_id for g in c.scheduler.grants()] == [other.reservation_id]
        assert all(h.gpus_subscribed == 0 for h in c.scheduler.view().hosts)


async def test_lazy_eviction_runs_before_another_kernel_gets_the_device() -> None:
    evictions: list[tuple[KernelId, tuple[int, ...]]] = []

    async def on_evict(k: KernelId, devices: tuple[int, ...]) -> None:
        evictions.append((k, devices))

    async with cluster({"h1": (0,), "h2": (0,)}) as c:
        await c.start_agent("h0", (0,), on_evict=on_evict)
        await c.scheduler.wait_for_hosts(3)
        a = await c.scheduler.acquire(kernel("a"), 1, replicas("h0"), last_executor=0, gpus=1)
        await c.scheduler.release(a, resident=True)
        # a again: its tensors are still there, nothing to evict.
        a2 = await c.scheduler.acquire(kernel("a"), 2, replicas("h0"), last_executor=0, gpus=1)
        await c.scheduler.release(a2, resident=True)
        assert evictions == []
        b = await c.scheduler.acquire(kernel("b"), 1, replicas("h0"), last_executor=0, gpus=1)
        assert evictions == [(kernel("a"), (0,))]
        assert c.pool("h0").resident() == {}
        await c.scheduler.release(b)


async def test_failed_eviction_refuses_and_the_cell_waits() -> None:
    async def hung(k: KernelId, devices: tuple[int, ...]) -> None:
        await anyio.sleep_forever()

    async with cluster({"h1": (0,), "h2": (0,)}) as c:
        await c.start_agent("h0", (0,), on_evict=hung, evict_timeout=0.1)
        await c.scheduler.wait_for_hosts(3)
        a = await c.scheduler.acquire(kernel("a"), 1, replicas("h0"), last_executor=0, gpus=1)
        await c.scheduler.release(a, resident=True)
        reasons: list[str] = []

        async def on_wait(reason: str) -> None:
            reasons.append(reason)

        # The refused eviction released the device without the resident mark; the
        # retry after the wait gets it.
        b = await c.scheduler.acquire(
            kernel("b"), 1, replicas("h0"), last_executor=0, gpus=1, on_wait=on_wait
        )
        assert reasons and "waiting" in reasons[0]
        assert b.host == "h0"
        await c.scheduler.release(b)


async def test_scheduler_drops_garbage_and_stray_messages() -> None:
    async with cluster(THREE) as c:
        rogue = c.network.endpoint("rogue")
        rogue.add_peer(PeerId("gateway"), c.gateway.address)
        await rogue.send(PeerId("gateway"), b"\x00garbage")
        await rogue.send(PeerId("gateway"), encode(GpuPrecommit(1, "r", "k", 1)))
        await rogue.send(PeerId("gateway"), encode(GpuFreed(424242)))
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        assert g.host == "h0"
        await c.scheduler.release(g)
        await rogue.aclose()


async def test_replica_gone_frees_its_host_and_its_resident_tensors() -> None:
    async with cluster(THREE) as c:
        a0 = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        await c.scheduler.release(a0, resident=True)
        a1 = await c.scheduler.acquire(kernel("a"), 2, ALL, last_executor=1, gpus=1)
        assert c.pool("h0").resident() == {0: "a"}
        await c.scheduler.replica_gone(kernel("a"), HostId("h0"))
        assert c.pool("h0").resident() == {}
        # The replica on h1 lives on: its grant is untouched.
        assert [g.reservation_id for g in c.scheduler.grants()] == [a1.reservation_id]
        assert held(c)["h1"] == 1


async def test_kernel_gone_reaches_a_suspected_host_when_it_is_back() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        await c.scheduler.committed(g)
        c.network.partition(["gateway"], ["h0/agent"])
        await eventually(lambda: c.scheduler.host(HostId("h0")).suspected)
        await c.scheduler.kernel_gone(kernel("a"))
        assert held(c)["h0"] == 1
        c.network.heal()
        await eventually(lambda: held(c)["h0"] == 0)


async def test_a_request_outliving_its_removed_host_suspects_nothing_in_the_model() -> None:
    async with cluster(THREE) as c:
        g = await c.scheduler.acquire(kernel("a"), 1, ALL, last_executor=0, gpus=1)
        await c.scheduler.committed(g)
        c.network.partition(["gateway"], ["h0/agent"])
        async with anyio.create_task_group() as tg:
            # its release to h0 times out after h0 left: the host it would suspect is gone
            tg.start_soon(c.scheduler.replica_gone, kernel("a"), HostId("h0"))
            await anyio.sleep(0.1)
            c.scheduler.remove_host(HostId("h0"))
        assert [h.host_id for h in c.scheduler.view().hosts] == ["h1", "h2"]
        other = await c.scheduler.acquire(kernel("b"), 1, ALL, last_executor=1, gpus=1)
        assert other.host == "h1"
