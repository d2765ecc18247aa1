"""GPU binding cost: moving a model's state off a GPU and back, against a raw pinned copy.

With CUDA: for models of 1, 4 and 16 GB (``NBOS_BENCH_GB=1,4,16``), the time for
``TorchGpuBinder`` to evict the state to pinned host memory and bind it back,
against ``torch`` copying the same bytes between a pinned buffer and the device;
and the cost of binding a cell whose model is still resident (lazy eviction).

Without CUDA it says so and measures what the CPU can: the same walk and moves
onto the CPU for smaller models (``NBOS_BENCH_MB``, default 64,256) against a raw
``copy_`` of the same bytes. Last line: the JSON summary.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import anyio
import torch

from nbos.gpu.binding import TorchGpuBinder

CUDA = torch.cuda.is_available()


def model_of(size_bytes: int, device: Any) -> torch.nn.Module:
    """Linear layers of 4096 x 4096 float32 (64 MiB each) adding up to about ``size_bytes``."""
    layer_bytes = 4096 * 4096 * 4
    layers = max(1, size_bytes // layer_bytes)
    linears = (torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers))
    return torch.nn.Sequential(*linears).to(device)


def state_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def raw_round_trip(nbytes: int, device: Any) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=CUDA)
    start = time.perf_counter()
    host.copy_(src, non_blocking=True)
    src.copy_(host, non_blocking=True)
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter() - start


async def binder_round_trip(model: torch.nn.Module, binder: TorchGpuBinder) -> float:
    start = time.perf_counter()
    await binder.release(evict=True)
    await binder.bind([0])
    return time.perf_counter() - start


async def resident_cell(binder: TorchGpuBinder, rounds: int = 200) -> float:
    times = []
    for _ in range(rounds):
        await binder.release(evict=False)
        start = time.perf_counter()
        await binder.bind([0])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def main() -> None:
    if CUDA:
        sizes = [int(g) << 30 for g in os.environ.get("NBOS_BENCH_GB", "1,4,16").split(",")]
        target = torch.device("cuda", 0)
        print(f"device: {torch.cuda.get_device_name(0)}")
    else:
        sizes = [int(m) << 20 for m in os.environ.get("NBOS_BENCH_MB", "64,256").split(",")]
        target = torch.device("cpu")
        print("no CUDA here: no transfer to measure; timing the binder's walk against a raw copy")
    summary: dict[str, Any] = {}
    for size in sizes:
        summary = await measure(size, target)
    print(json.dumps(summary))


async def measure(size: int, target: Any) -> dict[str, Any]:
    model = model_of(size, target)
    nbytes = state_bytes(model)
    namespace = {"model": model}
    binder = TorchGpuBinder(lambda: namespace, target=lambda _: target)
    await binder.bind([0])
    ours = min([await binder_round_trip(model, binder) for _ in range(3)])
    raw = min(raw_round_trip(nbytes, target) for _ in range(3))
    resident = await resident_cell(binder)
    gib = nbytes / 2**30
    print(f"{gib:6.2f} GiB: binder evict+bind {ours * 1e3:8.2f} ms, raw copy {raw * 1e3:8.2f} ms")
    print(f"          resident model, bind for the next cell: {resident * 1e6:.1f} us")
    summary: dict[str, Any] = {
        "bench": "gpu_bind",
        "anchor": "raw pinned torch copy of the same bytes",
    }
    if CUDA:
        gbps, raw_gbps = 2 * nbytes / ours / 1e9, 2 * nbytes / raw / 1e9
        print(f"          {gbps:.2f} GB/s against {raw_gbps:.2f} GB/s raw: {gbps / raw_gbps:.0%}")
        value, anchor, unit, better = gbps, raw_gbps, "GB/s", "higher"
        metric = f"evict+bind bandwidth, {gib:.0f} GiB model"
    else:
        value, anchor, unit, better = ours * 1e3, raw * 1e3, "ms", "lower"
        metric = f"evict+bind time, {gib:.2f} GiB model on the CPU (walk only, no transfer)"
    summary |= {"metric": metric, "unit": unit, "value": round(value, 4)}
    summary |= {"anchor_value": round(anchor, 4), "ratio": round(value / anchor, 4)}
    return summary | {"better": better}


if __name__ == "__main__":
    anyio.run(main)
