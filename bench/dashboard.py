"""What the dashboard costs the gateway: its CPU with the dashboard open, against without.

Starts ``nbos gateway --http`` (3 local agents of 2 virtual GPUs), starts
``NBOS_BENCH_KERNELS`` kernels over the API (default 50), lets it settle, then measures
the gateway process's CPU (user + system, its own process: not the agents', not the
replicas') over ``NBOS_BENCH_WINDOW_S`` seconds (default 30) twice: with no dashboard
open, then with ``NBOS_BENCH_FEEDS`` dashboards open (default 1), each a client that
reads the feed (``/dashboard/api/feed``) as the page does. It also times how far behind
the page is: from a kernel start's answer until the feed shows the kernel, and the age
of each pushed board when it arrives.

The last line is the JSON summary: the gateway's CPU with the dashboards open against
without. Run from the repository root: ``python bench/dashboard.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway._http import call, start_http_gateway, stop

KERNELS = int(os.environ.get("NBOS_BENCH_KERNELS", "50"))
WINDOW_S = float(os.environ.get("NBOS_BENCH_WINDOW_S", "30"))
FEEDS = int(os.environ.get("NBOS_BENCH_FEEDS", "1"))
TOKEN = "bench-dashboard"
#: Time for the kernels' starts to settle (elections, first heartbeats) before measuring.
SETTLE_S = 10.0


class Feed(threading.Thread):
    """One open dashboard: reads the feed's events as they come, as the page does."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.seen: dict[str, float] = {}  # kernel id -> when the feed first showed it
        self.lags: list[float] = []  # how old each pushed board was when it arrived
        self.bytes = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        request = urllib.request.Request(f"{self.url}/dashboard/api/feed")
        request.add_header("Authorization", f"token {TOKEN}")
        with urllib.request.urlopen(request, timeout=120) as response:
            kind = ""
            while not self.stopped.is_set():
                line = response.readline()
                if not line:
                    return
                self.bytes += len(line)
                if line.startswith(b"event: "):
                    kind = line[7:].strip().decode()
                elif line.startswith(b"data: ") and kind in ("hello", "board"):
                    self._board(json.loads(line[6:]), kind)

    def _board(self, data: dict[str, Any], kind: str) -> None:
        now = time.time()
        board = data["board"] if kind == "hello" else data
        self.lags.append(now - board["time"])
        for kernel in board["kernels"]:
            self.seen.setdefault(kernel["id"], now)


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def gateway_cpu(process: psutil.Process) -> float:
    """The gateway's CPU over the window, in % of one core."""
    before, began = cpu_s(process), time.monotonic()
    time.sleep(WINDOW_S)
    return 100.0 * (cpu_s(process) - before) / (time.monotonic() - began)


async def start_kernels(url: str, count: int) -> list[str]:
    ids = []
    while len(ids) < count:
        status, model = await call(f"{url}/api/kernels", "POST", {"name": "nbos"}, TOKEN)
        if status == 503:  # too many starting at once: ask again shortly
            await anyio.sleep(1.0)
            continue
        assert status == 201, model
        ids.append(model["id"])
    return ids


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="nbos-bench-dashboard-") as tmp:
        process, url, _ = start_http_gateway(Path(tmp), TOKEN)
        try:
            measure(process.pid, url)
        finally:
            stop(process)


def measure(pid: int, url: str) -> None:
    gateway = psutil.Process(pid)
    began = time.monotonic()
    anyio.run(start_kernels, url, KERNELS)
    print(f"{KERNELS} kernels started in {time.monotonic() - began:.0f} s")
    time.sleep(SETTLE_S)
    closed = gateway_cpu(gateway)
    print(f"gateway CPU, no dashboard open: {closed:.2f}% of one core over {WINDOW_S:g} s")
    feeds = [Feed(url) for _ in range(FEEDS)]
    for feed in feeds:
        feed.start()
    time.sleep(2.0)  # the first push (the whole state) is not the steady cost
    opened = gateway_cpu(gateway)
    print(f"gateway CPU, {FEEDS} dashboard(s) open: {opened:.2f}% of one core")
    # How fast the page follows: a kernel started now, until the feed shows it.
    asked = time.time()
    (kernel,) = anyio.run(start_kernels, url, 1)
    answered = time.time()
    deadline = time.monotonic() + 30
    while kernel not in feeds[0].seen and time.monotonic() < deadline:
        time.sleep(0.01)
    shown = feeds[0].seen.get(kernel)
    appear = shown - answered if shown is not None else float("nan")
    lags = sorted(lag for feed in feeds for lag in feed.lags)
    rate = sum(f.bytes for f in feeds) / FEEDS / (WINDOW_S + 2.0) / 1024
    print(
        f"a kernel started over the API showed {appear:.2f} s after its start was answered "
        f"({answered - asked:.1f} s to start); pushed boards were {statistics.median(lags):.2f} s "
        f"old at p50, {lags[int(0.99 * (len(lags) - 1))]:.2f} s at p99 on arrival; "
        f"{rate:.1f} KiB/s per open dashboard"
    )
    for feed in feeds:
        feed.stopped.set()
    summary = {
        "bench": "dashboard",
        "metric": f"gateway CPU with {FEEDS} dashboard(s) open on {KERNELS} kernels",
        "unit": "% of one core",
        "value": round(opened, 2),
        "anchor": "the same gateway with no dashboard open",
        "anchor_value": round(closed, 2),
        "ratio": round(opened / max(closed, 0.01), 2),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
