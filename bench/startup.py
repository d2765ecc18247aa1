"""Kernel start to the first cell's reply: nbos through its gateway vs a plain ipykernel.

Usage: ``python bench/startup.py [N]`` (or ``NBOS_BENCH_STARTUP_KERNELS``, default 5).

* ``nbos``: an in-process :class:`~nbos.gateway.service.GatewayService` with 3 local
  agents (``nbos agent`` processes, as ``nbos gateway`` starts them), durable Raft
  logs. One start is ``gateway.start_kernel()`` (3 replicas on 3 hosts, their Raft
  group, the kernel's front) and then the cell ``1`` through the front, until its reply.
  Other settings come from the environment as for ``nbos gateway`` (``NBOS_*``; e.g.
  ``NBOS_AGENT__WARM_REPLICAS=0`` for cold starts).
* ``ipykernel`` (the anchor): the ``python3`` kernelspec started by
  :class:`jupyter_client.manager.AsyncKernelManager`, then the same cell through a
  client once ``wait_for_ready`` passed, until its reply.

Starts alternate between the two, one kernel at a time, each shut down before the
next; ``NBOS_BENCH_STARTUP_GAP_S`` seconds (default 5) of quiet go before every start,
as between users opening notebooks (a host's pool of pre-started replicas refills in
that time). Goal (issue 12): at most 1.5x the plain ipykernel. The last line is the
JSON summary: p50 of nbos' start to first reply against ipykernel's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

from nbos.core.config import ClusterSettings, Settings
from nbos.gateway.service import GatewayService
from nbos.transport.ports import free_loopback_ports

KERNELS = (
    int(sys.argv[1])
    if len(sys.argv) > 1
    else int(os.environ.get("NBOS_BENCH_STARTUP_KERNELS", "5"))
)
GAP_S = float(os.environ.get("NBOS_BENCH_STARTUP_GAP_S", "5"))
CELL = "1"
# A client's first send blocks until the kernel's socket is there: a kernel that never
# binds (its port taken meanwhile) would hang the bench instead of failing it.
SEND_TIMEOUT_MS = 120_000


def settings(run_dir: Path) -> Settings:
    """This environment's settings with 3 local agents and loopback ports of our own."""
    loaded = Settings.load()
    control, agents = free_loopback_ports(2)
    gateway = msgspec.structs.replace(
        loaded.gateway,
        address=f"127.0.0.1:{control}",
        agent_address=f"127.0.0.1:{agents}",
        local_agents=True,
    )
    cluster = ClusterSettings(hosts=3, gpus_per_host=2, data_dir=str(run_dir))
    return msgspec.structs.replace(loaded, cluster=cluster, gateway=gateway)


async def nbos_start(service: GatewayService) -> float:
    begun = time.perf_counter()
    kernel = await service.kernel_manager.start_kernel()
    try:
        result = await kernel.execute(CELL, timeout=120)
        took = time.perf_counter() - begun
        if result.status != "ok":
            raise SystemExit(f"nbos: the first cell failed: {result.reply}")
        return took
    finally:
        await kernel.shutdown()


async def plain_start() -> float:
    begun = time.perf_counter()
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    manager = AsyncKernelManager(kernel_name="python3", context=context)
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=120)
        reply = await client.execute_interactive(CELL, timeout=120)
        took = time.perf_counter() - begun
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"ipykernel: the first cell failed: {reply['content']}")
        return took
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
        context.destroy(linger=0)


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="nbos-bench-startup-") as tmp:
        conf = settings(Path(tmp))
        print(
            f"{KERNELS} kernel starts each: nbos gateway (3 local agents, "
            f"[agent] warm_replicas = {conf.agent.warm_replicas}) vs plain ipykernel; "
            f"{GAP_S:g} s quiet before each start; cell {CELL!r}; {os.cpu_count()} CPUs",
            flush=True,
        )
        ours: list[float] = []
        plain: list[float] = []
        async with GatewayService.serve(conf, shutdown_kernels_on_exit=True) as service:
            for i in range(KERNELS):
                await anyio.sleep(GAP_S)
                ours.append(await nbos_start(service))
                await anyio.sleep(GAP_S)
                plain.append(await plain_start())
                print(
                    f"  start {i + 1}: nbos {ours[-1] * 1000:.0f} ms, "
                    f"ipykernel {plain[-1] * 1000:.0f} ms",
                    flush=True,
                )
    report(ours, plain)


def report(ours: list[float], plain: list[float]) -> None:
    def line(name: str, samples: list[float]) -> None:
        print(
            f"  {name}: p50 {statistics.median(samples) * 1000:7.0f} ms  "
            f"min {min(samples) * 1000:7.0f} ms  max {max(samples) * 1000:7.0f} ms"
        )

    print(f"start to first cell's reply, over {len(ours)} starts:")
    line("nbos     ", ours)
    line("ipykernel", plain)
    print("  goal (issue 12): at most 1.5x plain ipykernel")
    value, anchor = statistics.median(ours) * 1000, statistics.median(plain) * 1000
    summary = {
        "bench": "startup",
        "metric": "p50 time from asking for a kernel to its first cell's reply",
        "unit": "ms",
        "value": round(value, 1),
        "anchor": "plain ipykernel (AsyncKernelManager start, wait_for_ready, execute) p50",
        "anchor_value": round(anchor, 1),
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    anyio.run(main)
