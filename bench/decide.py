"""Control plane at scale: the time of each scheduling decision on a synthetic trace.

Usage: ``python bench/decide.py [SESSIONS [HOSTS]]`` (or ``NBOS_BENCH_DECIDE_SESSIONS``,
default 2,000, and ``NBOS_BENCH_DECIDE_HOSTS``, default 200).

The trace-driven simulator replays :func:`nbos.scaling.synthetic_trace` (SESSIONS sessions
over ``NBOS_BENCH_DECIDE_HOURS`` hours, default 8) on a fixed cluster of HOSTS hosts of 8
GPUs in nbos mode (3 replicas per kernel, the least-loaded policy, no autoscaler), and
every decision goes through :class:`~nbos.scaling.ClusterDecisions`, the object the
gateway's scheduler uses, over a :class:`~nbos.scaling.model.ClusterModel`, the model the
gateway's scheduler keeps too (whose host index lets least-loaded decide without ranking
every host). Each call (``place``, ``place_one``, ``reserve``, ``cell``,
``scale``) is timed, together with the :meth:`ClusterModel.view` it was given (the view is
rebuilt only after a change, so that cost is part of a decision too). The time is the
thread's CPU time (``time.thread_time_ns``), which a busy machine's preemptions do not
inflate; the wall-clock p99 is shown beside it.

The anchor is the same trace shape at a tenth of the size (SESSIONS/10 sessions on
HOSTS/10 hosts), run in the same process: constant work per decision means a ratio of
about 1, a cost that grows with the cluster a ratio well above it.

Goal (issue 12): per-decision p99 at most 1 ms on 10,000 sessions on 1,000 hosts. The
last line is the JSON summary: per-decision p99 at full size against the tenth.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from nbos.core.placement import ClusterView
from nbos.scaling import SimConfig, simulate, synthetic_trace
from nbos.scaling.decisions import ClusterDecisions
from nbos.scaling.model import ClusterModel
from nbos.scaling.registry import load_policy
from nbos.scaling.trace import validated

T = TypeVar("T")


def _arg(i: int, env: str, default: int) -> int:
    return int(sys.argv[i]) if len(sys.argv) > i else int(os.environ.get(env, str(default)))


SESSIONS = _arg(1, "NBOS_BENCH_DECIDE_SESSIONS", 2000)
HOSTS = _arg(2, "NBOS_BENCH_DECIDE_HOSTS", 200)
HOURS = float(os.environ.get("NBOS_BENCH_DECIDE_HOURS", "8"))


class Timings:
    """Nanoseconds per decision, by kind, and the views' rebuilds since the last decision."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[int]] = collections.defaultdict(list)
        self.wall: list[int] = []
        self.view_ns = self.view_wall_ns = 0

    def timed(self, kind: str, call: Callable[[], T]) -> T:
        start, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return call()
        finally:
            self.by_kind[kind].append(time.thread_time_ns() - start + self.view_ns)
            self.wall.append(time.perf_counter_ns() - wall + self.view_wall_ns)
            self.view_ns = self.view_wall_ns = 0

    def all(self) -> list[int]:
        return [ns for samples in self.by_kind.values() for ns in samples]


class TimedDecisions(ClusterDecisions):
    """The decisions, each timed (with the view rebuild that preceded it)."""

    timings: Timings

    def place(self, *args: Any, **kwargs: Any) -> Any:
        return self.timings.timed(
            "place", lambda: super(TimedDecisions, self).place(*args, **kwargs)
        )

    def place_one(self, *args: Any, **kwargs: Any) -> Any:
        return self.timings.timed(
            "place_one", lambda: super(TimedDecisions, self).place_one(*args, **kwargs)
        )

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        return self.timings.timed(
            "reserve", lambda: super(TimedDecisions, self).reserve(*args, **kwargs)
        )

    def cell(self, *args: Any, **kwargs: Any) -> Any:
        return self.timings.timed("cell", lambda: super(TimedDecisions, self).cell(*args, **kwargs))

    def scale(self, *args: Any, **kwargs: Any) -> Any:
        return self.timings.timed(
            "scale", lambda: super(TimedDecisions, self).scale(*args, **kwargs)
        )


class TimedModel(ClusterModel):
    """The model, its view rebuilds counted towards the next decision."""

    timings: Timings

    def view(self) -> ClusterView:
        start, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return super().view()
        finally:
            self.timings.view_ns += time.thread_time_ns() - start
            self.timings.view_wall_ns += time.perf_counter_ns() - wall


def run(sessions: int, hosts: int) -> tuple[Timings, float]:
    """Replay the trace; the timings and the run's wall-clock seconds."""
    trace = validated(synthetic_trace(sessions=sessions, hours=HOURS, seed=1))
    config = SimConfig(hosts=hosts, autoscaler=None)
    timings = Timings()
    decisions = TimedDecisions(load_policy(config.policy), config.replicas_per_kernel)
    decisions.timings = timings
    model = TimedModel(config.replicas_per_kernel)
    model.timings = timings
    start = time.perf_counter()
    result = simulate(trace, config, decisions=decisions, model=model)
    seconds = time.perf_counter() - start
    print(
        f"  {sessions} sessions on {hosts} hosts: {seconds:.2f} s, {len(timings.all())} "
        f"decisions, {result.cells_unserved} cells never run, {result.migrations} migrations"
    )
    return timings, seconds


def pct_us(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] / 1000


def show(name: str, timings: Timings) -> None:
    print(f"{name}:")
    for kind, samples in sorted(timings.by_kind.items()):
        print(
            f"  {kind:>9}: {len(samples):7d} decisions, p50 {pct_us(samples, 0.5):8.1f} us, "
            f"p99 {pct_us(samples, 0.99):8.1f} us, max {max(samples) / 1000:8.1f} us"
        )
    every = timings.all()
    print(
        f"  {'all':>9}: {len(every):7d} decisions, p50 {pct_us(every, 0.5):8.1f} us, "
        f"p99 {pct_us(every, 0.99):8.1f} us (CPU time; wall clock p99 "
        f"{pct_us(timings.wall, 0.99):.1f} us)"
    )


def main() -> None:
    small_sessions, small_hosts = max(1, SESSIONS // 10), max(3, HOSTS // 10)
    print(f"synthetic trace over {HOURS:g} h, 8 GPUs per host, least-loaded, no autoscaler")
    small, _ = run(small_sessions, small_hosts)
    large, _ = run(SESSIONS, HOSTS)
    show(f"{small_sessions} sessions on {small_hosts} hosts (anchor)", small)
    show(f"{SESSIONS} sessions on {HOSTS} hosts", large)
    print("goal (issue 12): per-decision p99 <= 1 ms at 10,000 sessions on 1,000 hosts")
    value, anchor = pct_us(large.all(), 0.99), pct_us(small.all(), 0.99)
    summary = {
        "bench": "decide",
        "metric": f"per-decision p99 (CPU time), {SESSIONS} sessions on {HOSTS} hosts",
        "unit": "us",
        "value": round(value, 1),
        "anchor": f"the same at {small_sessions} sessions on {small_hosts} hosts",
        "anchor_value": round(anchor, 1),
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
