"""CPU of a sporadic cell: what one cell on an otherwise idle kernel costs, all processes.

Usage: ``python bench/cell_cpu.py [CELLS]`` (or ``NBOS_BENCH_CELL_CPU_CELLS``, default 10).

A notebook's cells come seconds apart, and most kernels of a cluster are idle between
them: what a cell costs then is what a host pays per cell, whatever the cell's own code.

* ``ipykernel`` (the anchor, first, alone): the ``python3`` kernelspec started by
  :class:`jupyter_client.manager.AsyncKernelManager`, its client in this process; the
  cell ``x += 1`` ``CELLS`` times, each after ``NBOS_BENCH_CELL_CPU_GAP_S`` seconds
  (default 2) of quiet.
* ``nbos``: one replicated kernel on :class:`nbos.LocalCluster` (3 hosts, durable Raft
  logs; the gateway, agents and front in this process, the replicas its children),
  the same cells after the same gaps. Its Raft group goes quiet between them
  (``[raft] quiesce_ticks``, ``docs/raft.md``), and wakes for each.

CPU is the user and system time of this process and the kernel's processes
(``/proc/PID/stat``, every thread), from before the first cell to one gap after the last
(a cell's wake and what follows it count), divided by the cells. Settings come from the
environment as for ``nbos gateway`` (``NBOS_RAFT__QUIESCE_TICKS=100`` for the old
default). The last line is the JSON summary: nbos' CPU per cell against ipykernel's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
from _measure import TICK, cpu_ticks, descendants
from jupyter_client.manager import AsyncKernelManager

import nbos
from nbos.core.config import Settings

CELLS = (
    int(sys.argv[1])
    if len(sys.argv) > 1
    else int(os.environ.get("NBOS_BENCH_CELL_CPU_CELLS", "10"))
)
GAP_S = float(os.environ.get("NBOS_BENCH_CELL_CPU_GAP_S", "2"))
CELL = "x += 1"


async def cpu_per_cell(cell: Callable[[], Awaitable[object]], pids: set[int]) -> float:
    """Milliseconds of CPU that ``pids`` spend per ``cell``, each after ``GAP_S`` of quiet."""
    await anyio.sleep(GAP_S)
    before = cpu_ticks(pids)
    for _ in range(CELLS):
        await cell()
        await anyio.sleep(GAP_S)
    after = cpu_ticks(pids)
    ticks = sum(after[p] - t for p, t in before.items() if p in after)
    return 1e3 * ticks / TICK / CELLS


async def ipykernel_ms() -> float:
    manager = AsyncKernelManager(kernel_name="python3")
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)

        async def cell() -> None:
            reply = await client.execute_interactive(CELL, timeout=60)
            assert reply["content"]["status"] == "ok", reply

        await client.execute_interactive("x = 0", timeout=60)
        return await cpu_per_cell(cell, descendants(os.getpid()))
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


async def nbos_ms() -> float:
    async with nbos.LocalCluster(hosts=3, settings=Settings.load()) as cluster:
        kernel = await cluster.start_kernel()

        async def cell() -> None:
            result = await kernel.execute(CELL)
            assert result.status == "ok", result.reply

        await kernel.execute("x = 0")
        return await cpu_per_cell(cell, descendants(os.getpid()))


async def main() -> None:
    quiesce = Settings.load().raft.quiesce_ticks
    print(
        f"{CELLS} cells {CELL!r}, each after {GAP_S:g} s of quiet; nbos [raft] quiesce_ticks "
        f"{quiesce}; {os.cpu_count()} CPUs; clock tick {1e3 / TICK:g} ms"
    )
    began = time.monotonic()
    anchor = await ipykernel_ms()
    ours = await nbos_ms()
    print(f"ipykernel: {anchor:.1f} ms of CPU per cell (its process and this client)")
    print(f"nbos:      {ours:.1f} ms of CPU per cell (3 replicas, gateway, agents, front)")
    print(f"took {time.monotonic() - began:.0f} s")
    anchor_value = max(anchor, 1e3 / TICK / CELLS)  # at least one tick over the cells
    summary = {
        "bench": "cell_cpu",
        "metric": f"CPU per sporadic cell ({CELL!r} every {GAP_S:g} s), all processes",
        "unit": "ms",
        "value": round(ours, 1),
        "anchor": "the same cells on one plain ipykernel (at least one clock tick)",
        "anchor_value": round(anchor_value, 1),
        "ratio": round(ours / anchor_value, 2),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    anyio.run(main)
