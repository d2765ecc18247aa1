"""A burst of kernel starts over the HTTP API, each client asking again after ``Retry-After``.

Starts ``nbos gateway --http`` (3 local agents, default settings: at most ``[gateway]
max_starting`` starts at once, one more refused with 503 and ``Retry-After``), then:

1. **an existing kernel's cell, quiet**: ``NBOS_BENCH_CELLS`` cells (default 100) of
   ``pass`` over its WebSocket, from ``execute_request`` to its reply and ``idle``;
2. **one start on an idle cluster**: ``POST /api/kernels`` to its first cell's reply and
   ``idle``, ``NBOS_BENCH_STARTS`` times (default 3, each kernel deleted after; the
   median is the anchor);
3. **the burst**: ``NBOS_BENCH_KERNELS`` clients (default 100, fewer when the machine has
   too little memory for them: each kernel takes about 130 MiB) each ``POST
   /api/kernels`` at once; a 503 is asked again after its ``Retry-After``; each client's
   start is timed from its first request to its first cell's reply and ``idle``.
   Meanwhile the existing kernel runs cells back to back (their p99 against quiet).

The last line is the JSON summary: the burst's p99 start against one start on an idle
cluster; the cell's p99 during the burst against quiet is in the figures and the anchor.
Run from the repository root: ``python bench/start_burst.py``.
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
import httpx
from _measure import pct
from http_gateway import TOKEN, open_socket, over_ws, start_to_first_reply

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway._http import KernelSocket, start_http_gateway, stop

KERNELS = int(os.environ.get("NBOS_BENCH_KERNELS", "100"))
CELLS = int(os.environ.get("NBOS_BENCH_CELLS", "100"))
STARTS = int(os.environ.get("NBOS_BENCH_STARTS", "3"))
#: What one kernel takes (3 replicas and its front), to size the burst to the machine.
KERNEL_MIB = 130
#: A client refused for this long gives up (a refusal that does not end: hosts full).
GIVE_UP_S = 900.0
#: Of the memory available, what the kernels may take.
MEMORY_SHARE = 0.6


def kernels_that_fit(wanted: int) -> int:
    """``wanted``, or fewer so that they take at most a share of the memory available."""
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if "MemAvailable" in line)
    fit = int(available_kib / 1024 * MEMORY_SHARE / KERNEL_MIB)
    if fit < wanted:
        print(f"{wanted} kernels do not fit in memory available now: {fit} instead")
    return max(1, min(wanted, fit))


def room_for(kernels: int) -> dict[str, str]:
    """Gateway settings whose hosts take ``kernels`` kernels (and the anchor's starts)."""
    return {"NBOS_CLUSTER__MAX_REPLICAS_PER_HOST": str(kernels + 8)}


class Burst:
    """Clients that each start a kernel, asking again after ``Retry-After``."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.took_s: list[float] = []
        self.refusals = 0
        self.failures: list[str] = []
        self.kernel_ids: list[str] = []

    async def client(self, http: httpx.AsyncClient) -> None:
        begun = time.perf_counter()
        while (answer := await http.post(f"{self.base}/api/kernels", json={})).status_code == 503:
            self.refusals += 1
            if time.perf_counter() - begun > GIVE_UP_S:
                break
            await anyio.sleep(int(answer.headers.get("Retry-After", "1")))
        if answer.status_code != 201:
            self.failures.append(f"{answer.status_code} {answer.text}")
            return
        kernel_id = answer.json()["id"]
        self.kernel_ids.append(kernel_id)
        ws = await open_socket(self.base, kernel_id)
        try:
            await over_ws(ws)()
        finally:
            ws.close()
        self.took_s.append(time.perf_counter() - begun)

    async def run(self, count: int) -> None:
        headers = {"Authorization": f"token {TOKEN}"}
        limits = httpx.Limits(max_connections=count + 1)
        async with (
            httpx.AsyncClient(headers=headers, limits=limits, timeout=600) as http,
            anyio.create_task_group() as tg,
        ):
            for _ in range(count):
                tg.start_soon(self.client, http)

    async def delete_all(self) -> None:
        headers = {"Authorization": f"token {TOKEN}"}
        async with httpx.AsyncClient(headers=headers, timeout=600) as http:
            limiter = anyio.CapacityLimiter(8)

            async def delete(kernel_id: str) -> None:
                async with limiter:
                    await http.delete(f"{self.base}/api/kernels/{kernel_id}")

            async with anyio.create_task_group() as tg:
                for kernel_id in self.kernel_ids:
                    tg.start_soon(delete, kernel_id)


async def cells_until(ws: KernelSocket, done: anyio.Event) -> list[float]:
    """Milliseconds of ``pass`` cells run back to back until ``done``."""
    cell, times = over_ws(ws), []
    while not done.is_set():
        begun = time.perf_counter()
        await cell()
        times.append((time.perf_counter() - begun) * 1e3)
    return times


async def main(base: str, count: int) -> dict[str, object]:
    headers = {"Authorization": f"token {TOKEN}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as http:
        existing = (await http.post(f"{base}/api/kernels", json={})).json()["id"]
    ws = await open_socket(base, existing)
    cell = over_ws(ws)
    for _ in range(5):
        await cell()
    quiet = []
    for _ in range(CELLS):
        begun = time.perf_counter()
        await cell()
        quiet.append((time.perf_counter() - begun) * 1e3)
    one = [await start_to_first_reply(base, "nbos") for _ in range(STARTS)]
    print(f"one start: {[round(s, 2) for s in one]} s", flush=True)

    burst, done = Burst(base), anyio.Event()
    during: list[float] = []

    async def probe() -> None:
        during.extend(await cells_until(ws, done))

    begun = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        await burst.run(count)
        done.set()
    burst_s = time.perf_counter() - begun
    ws.close()
    await burst.delete_all()
    figures: dict[str, object] = {
        "kernels": count,
        "all_started": len(burst.took_s) == count and not burst.failures,
        "failures": burst.failures[:5],
        "refusals_503": burst.refusals,
        "burst_s": round(burst_s, 1),
        "one_start_s": round(statistics.median(one), 3),
        "burst_start_p50_s": round(pct(burst.took_s, 0.5), 3),
        "burst_start_p99_s": round(pct(burst.took_s, 0.99), 3),
        "cell_quiet_p99_ms": round(pct(quiet, 0.99), 2),
        "cell_burst_p99_ms": round(pct(during, 0.99), 2),
        "cell_quiet_p50_ms": round(pct(quiet, 0.5), 2),
        "cell_burst_p50_ms": round(pct(during, 0.5), 2),
        "cells_during_burst": len(during),
    }
    figures["start_p99_ratio"] = round(
        float(str(figures["burst_start_p99_s"])) / float(str(figures["one_start_s"])), 2
    )
    figures["cell_p99_ratio"] = round(
        float(str(figures["cell_burst_p99_ms"])) / float(str(figures["cell_quiet_p99_ms"])), 2
    )
    for key, value in figures.items():
        print(f"{key:22} {value}")
    return figures


def run(tmp: Path) -> dict[str, object]:
    count = kernels_that_fit(KERNELS)
    gateway, url, _ = start_http_gateway(tmp, TOKEN, room_for(count))
    try:
        return anyio.run(main, url, count)
    finally:
        stop(gateway)


def closing_line(figures: dict[str, object]) -> dict[str, object]:
    value = float(str(figures["burst_start_p99_s"]))
    anchor = float(str(figures["one_start_s"]))
    return {
        "bench": "start_burst",
        "metric": f"p99 start (first request to first cell's reply) of {figures['kernels']} "
        "kernels asked for at once over POST /api/kernels, refused ones asking again after "
        f"Retry-After (all started: {figures['all_started']}, "
        f"{figures['refusals_503']} refusals); an existing kernel's cell p99 "
        f"{figures['cell_burst_p99_ms']} ms during the burst, {figures['cell_p99_ratio']}x "
        "quiet",
        "unit": "s",
        "value": value,
        "anchor": "one start on an idle cluster (median); the existing kernel's cell p99 "
        f"quiet: {figures['cell_quiet_p99_ms']} ms",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-burst-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
