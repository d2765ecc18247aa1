"""What several benchmarks measure alike: a cell's round trip, CPU time and memory of
processes, percentiles.

Not a benchmark itself: the benches import it (``from _measure import ...``: a script's
own folder is first on ``sys.path``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
from jupyter_client.asynchronous.client import AsyncKernelClient

TICK = os.sysconf("SC_CLK_TCK")
CELL_TIMEOUT_S = 300.0


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc/*/stat``'s parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def children(parent: int) -> set[int]:
    return set(_children().get(parent, ()))


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    children = _children()
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` from field 3 (state) on: the command name may hold spaces."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return raw[raw.rindex(")") + 2 :].split()


def cpu_ticks(pids: Iterable[int]) -> dict[int, int]:
    """utime + stime in clock ticks of each process still there."""
    ticks = {}
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks


def started_at(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``None``: it ended, a zombie too):
    with the pid, it names one process, not a later one given the same pid."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KiB, from ``/proc/PID/smaps_rollup``."""
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                values[key] = int(rest.split()[0])
    return values["Rss"], values["Pss"]


@dataclass
class Group:
    """Processes whose CPU is summed: a name and the pids."""

    name: str
    pids: set[int]


def measure_cpu(groups: list[Group], window: float) -> dict[str, float]:
    """% of one core each group used over ``window`` seconds (processes there at both ends)."""
    before = {g.name: cpu_ticks(g.pids) for g in groups}
    start = time.monotonic()
    time.sleep(window)  # the caller must be idle too when it is part of a group
    after = {g.name: cpu_ticks(g.pids) for g in groups}
    elapsed = time.monotonic() - start
    used = {}
    for g in groups:
        ticks = sum(after[g.name][p] - t for p, t in before[g.name].items() if p in after[g.name])
        used[g.name] = 100 * ticks / TICK / elapsed
    return used


async def run_cell(client: AsyncKernelClient, code: str, **kwargs: Any) -> tuple[float, Any]:
    """One cell's round trip in seconds, and its execute_reply; exits if the cell failed."""
    begun = time.perf_counter()
    msg_id = client.execute(code, allow_stdin=False, stop_on_error=False, **kwargs)
    with anyio.fail_after(CELL_TIMEOUT_S):
        while (reply := await client.get_shell_msg())["parent_header"].get("msg_id") != msg_id:
            pass
        while True:
            msg = await client.get_iopub_msg()
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                break
    elapsed = time.perf_counter() - begun
    content = reply["content"]
    if content.get("status") != "ok":
        raise SystemExit(f"cell {code!r} failed: {content}")
    return elapsed, reply


async def connect(info: Any) -> AsyncKernelClient:
    client = AsyncKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    return client
