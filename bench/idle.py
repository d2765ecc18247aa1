"""CPU and memory of idle kernels: N idle nbos kernels on one cluster vs one idle ipykernel.

Usage: ``python bench/idle.py [N]`` (or ``NBOS_BENCH_IDLE_KERNELS``, default 20).

* ``nbos``: N replicated kernels on one :class:`nbos.LocalCluster` (3 hosts, 3 replica
  processes per kernel, durable Raft logs). The gateway, the host agents and every
  kernel's front run in this process; the replicas are its child processes. Every kernel
  ran one cell, then the cluster is left alone for ``NBOS_BENCH_IDLE_SETTLE_S`` seconds
  (default 15: longer than the fronts' wait before they back their pings off) before
  the window.
* ``ipykernel`` (the anchor): the ``python3`` kernelspec started by
  :class:`jupyter_client.manager.AsyncKernelManager`, after one cell; no client stays
  connected to it, as no client stays connected to the nbos kernels.

CPU is the user and system time of the processes (``/proc/PID/stat``, every thread,
children that ended not included) over a window of ``NBOS_BENCH_IDLE_WINDOW_S`` seconds
(default 20), in % of one core. This process counts towards nbos, the anchor's kernel
process tree towards ipykernel. The clock tick is the resolution: an anchor that took no
tick in the window is counted as one tick, so the ratio stays finite (and then
understates nbos' cost relative to ipykernel).

Memory: the resident set (RSS) and the proportional set (PSS, shared pages split among
their users) of one kernel's 3 replicas against the anchor kernel's; the gateway process
is shown on its own.

Goal (issue 12): 50 idle kernels on one cluster under 5% of one core. The last line is
the JSON summary: CPU of the N idle nbos kernels (all processes) against the one idle
ipykernel.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
from _measure import TICK, Group, descendants, measure_cpu, memory_kib
from jupyter_client.manager import AsyncKernelManager

import nbos

KERNELS = (
    int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("NBOS_BENCH_IDLE_KERNELS", "20"))
)
WINDOW_S = float(os.environ.get("NBOS_BENCH_IDLE_WINDOW_S", "20"))
SETTLE_S = float(os.environ.get("NBOS_BENCH_IDLE_SETTLE_S", "15"))
MIB = 2**20


async def main() -> None:
    print(
        f"{KERNELS} idle nbos kernels on LocalCluster(hosts=3), anchor: one idle plain "
        f"ipykernel; window {WINDOW_S:g} s after {SETTLE_S:g} s of quiet; {os.cpu_count()} CPUs"
    )
    manager = AsyncKernelManager(kernel_name="python3")
    await manager.start_kernel()
    plain = manager.client()
    plain.start_channels()
    try:
        await plain.wait_for_ready(timeout=60)
        await plain.execute_interactive("x = 1", timeout=60)
        plain.stop_channels()
        async with nbos.LocalCluster(hosts=3) as cluster:
            kernels = []
            for _ in range(KERNELS):
                kernel = await cluster.start_kernel()
                result = await kernel.execute("x = 1")
                if result.status != "ok":
                    raise SystemExit(f"the first cell failed: {result.reply}")
                kernels.append(kernel)
            await anyio.sleep(SETTLE_S)
            anchor_pid = manager.provisioner.pid  # type: ignore[union-attr]
            anchor = descendants(anchor_pid)
            ours = descendants(os.getpid()) - anchor
            replicas = [r.pid for r in kernels[0].replicas if r.pid is not None]
            groups = [
                Group("nbos", ours),
                Group("gateway", {os.getpid()}),
                Group("ipykernel", anchor),
            ]
            cpu = await anyio.to_thread.run_sync(measure_cpu, groups, WINDOW_S)
            report(cpu, replicas, anchor, len(ours))
    finally:
        await manager.shutdown_kernel(now=True)


def report(cpu: dict[str, float], replicas: list[int], anchor: set[int], processes: int) -> None:
    floor = 100 / TICK / WINDOW_S
    print(f"CPU over {WINDOW_S:g} s (resolution {floor:.3f}% of a core):")
    print(
        f"  nbos, {KERNELS} kernels ({processes} processes): {cpu['nbos']:.3f}% of one core, "
        f"{cpu['nbos'] / KERNELS:.3f}% per kernel; of which the gateway process (agents, "
        f"fronts, this bench) {cpu['gateway']:.3f}%, the replicas "
        f"{cpu['nbos'] - cpu['gateway']:.3f}%"
    )
    print(f"  ipykernel, 1 kernel ({len(anchor)} processes): {cpu['ipykernel']:.3f}% of one core")
    print("  goal (issue 12): 50 idle kernels under 5% of one core")
    rss = pss = 0
    for pid in replicas:
        r, p = memory_kib(pid)
        rss, pss = rss + r, pss + p
    plain_rss = plain_pss = 0
    for pid in anchor:
        r, p = memory_kib(pid)
        plain_rss, plain_pss = plain_rss + r, plain_pss + p
    gw_rss, gw_pss = memory_kib(os.getpid())
    print(
        f"memory of one kernel: nbos 3 replicas RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB;"
        f" ipykernel RSS {plain_rss / 1024:.0f} MiB, PSS {plain_pss / 1024:.0f} MiB; "
        f"ratio RSS {rss / plain_rss:.2f}x, PSS {pss / plain_pss:.2f}x (goal <= 3.3x)"
    )
    print(
        f"gateway process (agents, {KERNELS} fronts, this bench): RSS {gw_rss / 1024:.0f} MiB, "
        f"PSS {gw_pss / 1024:.0f} MiB"
    )
    anchor_value = max(cpu["ipykernel"], floor)
    summary = {
        "bench": "idle",
        "metric": f"CPU of {KERNELS} idle kernels on one cluster, all processes",
        "unit": "% of one core",
        "value": round(cpu["nbos"], 3),
        "anchor": "one idle plain ipykernel (at least one clock tick over the window)",
        "anchor_value": round(anchor_value, 3),
        "ratio": round(cpu["nbos"] / anchor_value, 3),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    anyio.run(main)
