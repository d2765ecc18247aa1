"""Admission in the embedded cluster: the kernel manager's bound on starts and the per-host
limits (replicas, free memory as the agents report it) refuse a start at once, as
overloaded, and hurt no kernel that runs."""

from __future__ import annotations

import anyio
import pytest

import nbos
from nbos.core.config import ClusterSettings, GatewaySettings, Settings
from nbos.core.errors import OverloadedError
from nbos.gateway import Kernel

pytestmark = pytest.mark.anyio


async def test_a_start_past_the_bound_or_past_the_hosts_limits_is_refused_at_once() -> None:
    settings = Settings(
        cluster=ClusterSettings(max_replicas_per_host=1, min_free_memory_mib=0),
        gateway=GatewaySettings(max_starting=1, start_wait_s=0),
    )
    async with nbos.LocalCluster(hosts=3, durable=False, settings=settings) as cluster:
        started: list[Kernel] = []
        refused: list[OverloadedError] = []

        async def start() -> None:
            try:
                started.append(await cluster.start_kernel())
            except OverloadedError as exc:
                refused.append(exc)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(start)
                tg.start_soon(start)
        assert len(started) == 1, refused
        (busy,) = refused
        assert "1 kernels are starting" in str(busy) and busy.retry_after_s >= 1
        assert cluster.kernel_manager.admission.running == 0

        # Every host holds one replica now: the next kernel finds no room.
        with pytest.raises(OverloadedError, match="hosts at their limits: host-1, host-2"):
            await cluster.start_kernel()
        (kernel,) = started
        assert (await kernel.execute("print(6 * 7)")).stdout == "42\n"

        await kernel.shutdown()
        with anyio.fail_after(120):
            while True:  # the kernel's end frees its hosts: asked again, it is placed
                try:
                    second = await cluster.start_kernel()
                    break
                except OverloadedError as exc:
                    await anyio.sleep(min(exc.retry_after_s, 0.5))
        assert (await second.execute("print(1)")).stdout == "1\n"


async def test_a_start_past_the_bound_waits_for_a_slot_within_start_wait_s() -> None:
    settings = Settings(gateway=GatewaySettings(max_starting=1, start_wait_s=60))
    async with nbos.LocalCluster(hosts=3, durable=False, settings=settings) as cluster:
        admission = cluster.kernel_manager.admission
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, admission.running)
                await anyio.sleep(0.01)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                async with anyio.create_task_group() as starts:
                    starts.start_soon(cluster.start_kernel)
                    starts.start_soon(cluster.start_kernel)
                tg.cancel_scope.cancel()
        # The second waited for the first's slot and took it: both run, one at a time.
        assert len(cluster.kernels) == 2 and most == 1
        for kernel in cluster.kernels:
            assert (await kernel.execute("print(6 * 7)")).stdout == "42\n"


async def test_hosts_short_of_free_memory_take_no_replica() -> None:
    # More free memory than any machine has: each agent's report keeps its host full.
    settings = Settings(cluster=ClusterSettings(min_free_memory_mib=1 << 40))
    async with nbos.LocalCluster(hosts=3, durable=False, settings=settings) as cluster:
        with pytest.raises(OverloadedError, match="hosts at their limits") as refused:
            await cluster.start_kernel()
        assert refused.value.retry_after_s >= 1
        assert cluster.kernels == ()
