"""Simulator speed: seconds per simulated day on the month-long task trace, both modes.

Replays ``shared/traces/adobe_june_tasks.csv`` (339 sessions by its README, 337 by
the importer's rule, 30,909 cells, 720 h; ``NBOS_BENCH_TRACE`` names another trace)
in nbos mode and in the reservation baseline with the default config (4 hosts of 8
GPUs, autoscaled up to 64 hosts), and reports wall-clock seconds per simulated day.

The anchor is the raw event count: a bare ``heapq`` loop that pushes and pops the
same number of events the run had (session starts and stops, cell submissions and
ends, one tick per minute) and does nothing with them. The ratio says how many times
that floor the simulator costs; the issue's goal is both modes under 30 s in all.
Last line: the JSON summary.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from pathlib import Path

from nbos.scaling import SimConfig, SimResult, Trace, load_trace, simulate, synthetic_trace

TRACE = Path("shared") / "traces" / "adobe_june_tasks.csv"
# shared/ sits beside the checkout (or beside its worktrees' folder).
MONTH = next(
    (p / TRACE for p in Path(__file__).resolve().parents if (p / TRACE).exists()),
    TRACE,
)


def the_trace() -> tuple[Trace, str]:
    path = Path(os.environ.get("NBOS_BENCH_TRACE", MONTH))
    if path.exists():
        return load_trace(path), path.name
    print(f"no trace at {path}: using the default synthetic trace instead")
    return synthetic_trace(), "synthetic (59 sessions, 48 h)"


def raw_events(trace: Trace, result: SimResult, tick: float) -> int:
    """Events a run of ``trace`` handles at least: every session start and stop, every
    cell submission and end, and a tick per ``tick`` seconds simulated."""
    cells = sum(len(s.cells) for s in trace.sessions)
    return 2 * len(trace.sessions) + 2 * cells + int(result.hours * 3600 / tick)


def bare_loop(events: int) -> float:
    """Seconds to push and pop ``events`` heap entries shaped like the simulator's."""
    start = time.perf_counter()
    heap: list[tuple[float, int, int, None]] = []
    for i in range(events):
        heapq.heappush(heap, (float(i % 9973), i % 7, i, None))
    while heap:
        heapq.heappop(heap)
    return time.perf_counter() - start


def main() -> None:
    trace, name = the_trace()
    days = trace.end / 86400
    cells = sum(len(s.cells) for s in trace.sessions)
    print(f"trace: {name}: {len(trace.sessions)} sessions, {cells} cells, {days:.1f} days")
    spent = floor = 0.0
    for mode in ("nbos", "reservation"):
        config = SimConfig(mode=mode)
        start = time.perf_counter()
        result = simulate(trace, config)
        seconds = time.perf_counter() - start
        events = raw_events(trace, result, config.tick)
        bare = bare_loop(events)
        spent, floor = spent + seconds, floor + bare
        print(
            f"{mode:>11}: {seconds:6.2f} s ({seconds / days:.3f} s per simulated day), "
            f"{events} raw events (bare loop {bare:.2f} s); {result.cells_unserved} cells "
            f"never run, {result.hours_at_ceiling:.0f} h at the host ceiling"
        )
    print(f"both modes: {spent:.2f} s (goal: under 30 s)")
    value, anchor = spent / (2 * days), floor / (2 * days)
    summary = {
        "bench": "simulate",
        "metric": f"seconds per simulated day, both modes, {name}",
        "unit": "s/day",
        "value": round(value, 4),
        "anchor": "bare heapq loop over the run's raw event count",
        "anchor_value": round(anchor, 4),
        "ratio": round(value / anchor, 2),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
