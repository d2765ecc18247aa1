"""A cell through the gateway's WebSocket with many live kernels, against the same with one.

Starts ``nbos gateway --http`` (3 local agents: 3 virtual hosts) and one kernel, then
times ``NBOS_BENCH_CELLS`` cells (default 200) of ``pass`` on it over its WebSocket (from
``execute_request`` to its reply and ``idle``) three times:

1. with that kernel alone;
2. with ``NBOS_BENCH_KERNELS`` live kernels in all (default 100, fewer when the machine has
   too little memory for them: each takes about 130 MiB), the others started over ``POST
   /api/kernels`` as a burst whose refused clients ask again after ``Retry-After``, each
   having run one cell, then idle; after ``NBOS_BENCH_SETTLE_S`` seconds (default 10);
3. with that kernel alone again, the others deleted.

The anchor is the cells of 1 and 3 together (so that a machine whose load changed over the
run weighs on both sides). The last line is the JSON summary: p50 with N kernels against
p50 with one. Run from the repository root: ``python bench/many_kernels.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
from _measure import pct
from http_gateway import TOKEN, open_socket, over_ws
from start_burst import Burst, kernels_that_fit, room_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway._http import KernelSocket, start_http_gateway, stop

KERNELS = int(os.environ.get("NBOS_BENCH_KERNELS", "100"))
CELLS = int(os.environ.get("NBOS_BENCH_CELLS", "200"))
SETTLE_S = float(os.environ.get("NBOS_BENCH_SETTLE_S", "10"))


async def timed_cells(ws: KernelSocket) -> list[float]:
    cell, times = over_ws(ws), []
    for _ in range(10):
        await cell()
    for _ in range(CELLS):
        begun = time.perf_counter()
        await cell()
        times.append((time.perf_counter() - begun) * 1e3)
    return times


async def main(base: str, count: int) -> dict[str, object]:
    headers = {"Authorization": f"token {TOKEN}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as http:
        kernel_id = (await http.post(f"{base}/api/kernels", json={})).json()["id"]
    ws = await open_socket(base, kernel_id)
    await anyio.sleep(SETTLE_S)  # the warm pool refills after a start
    alone = await timed_cells(ws)
    others = Burst(base)
    await others.run(count - 1)
    if others.failures or len(others.took_s) != count - 1:
        raise SystemExit(f"not all kernels started: {others.failures[:3]}")
    await anyio.sleep(SETTLE_S)
    crowded = await timed_cells(ws)
    await others.delete_all()
    await anyio.sleep(SETTLE_S)
    alone += await timed_cells(ws)
    ws.close()
    figures: dict[str, object] = {
        "kernels": count,
        "one_p50_ms": round(pct(alone, 0.5), 2),
        "one_p99_ms": round(pct(alone, 0.99), 2),
        "many_p50_ms": round(pct(crowded, 0.5), 2),
        "many_p99_ms": round(pct(crowded, 0.99), 2),
        "starts_refused_503": others.refusals,
        "start_p99_s": round(pct(others.took_s, 0.99), 2) if others.took_s else None,
    }
    for key, value in figures.items():
        print(f"{key:20} {value}")
    return figures


def run(tmp: Path) -> dict[str, object]:
    count = kernels_that_fit(KERNELS)
    gateway, url, _ = start_http_gateway(tmp, TOKEN, room_for(count))
    try:
        return anyio.run(main, url, count)
    finally:
        stop(gateway)


def closing_line(figures: dict[str, object]) -> dict[str, object]:
    value = float(str(figures["many_p50_ms"]))
    anchor = float(str(figures["one_p50_ms"]))
    return {
        "bench": "many_kernels",
        "metric": f"trivial cell p50 over the gateway's WebSocket with {figures['kernels']} "
        "live kernels on 3 virtual hosts",
        "unit": "ms",
        "value": value,
        "anchor": "the same cell with that kernel alone (before and after)",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-many-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
