"""One ``nbos gateway`` with N kernels: starts per second, cell round trips, idle CPU.

Usage: ``python bench/gateway.py [N]`` (or ``NBOS_BENCH_GATEWAY_KERNELS``, default 50, at
most 200). Each kernel is 3 replica processes of together about 180 MiB RSS (130 MiB PSS),
so 50 kernels take about 6.5 GiB (PSS; 24 GiB machines run them): the run stops with a
message, before the next start, once the machine has less than 2 GiB available.

The gateway is the daemon ``python -m nbos gateway`` as a user starts it with no cluster
file (3 local ``nbos agent`` processes of virtual GPUs, the replicas their children), with
a data dir (durable, as deployed). This process is only its client: kernels are started by
the control API (``StartKernel``, what the ``nbos`` kernelspec asks) and cells run through
:class:`~jupyter_client.asynchronous.client.AsyncKernelClient` on each kernel's front.

1. **Starts**: N kernels, ``NBOS_BENCH_GATEWAY_PARALLEL`` start requests in flight at a
   time (default 2); kernels per second over the whole phase, and each start's time.
2. **Cell round trip** of ``pass`` (from ``execute_request`` until its reply and its
   ``idle``, as a notebook waits) on one gateway kernel while the other N-1 are live and
   idle, against the same cell on one embedded kernel (the anchor:
   ``nbos.LocalCluster(hosts=3)`` in this process, the embedding API of ``docs/kernel.md``)
   measured in the same run, in alternating blocks of ``NBOS_BENCH_BLOCK`` cells (default
   20) up to ``NBOS_BENCH_GATEWAY_CELLS`` cells each (default 200), after warm-up cells.
   The anchor's front and agents run in this process, beside the clients that time both
   (as embedding has it), while the gateway's fronts have a process of their own: on a
   machine with cores to spare the gateway pays one more hop, on a loaded one its own
   share of CPU time can make it the faster. Then the cell round-robin over all N
   gateway kernels (``NBOS_BENCH_GATEWAY_PASSES`` passes, default 2, after one untimed
   pass): each kernel was idle while the others ran theirs, longer than the 0.2 s after
   which its Raft group goes quiet (``[raft] quiesce_ticks``, ``docs/raft.md``), so these
   cells wake their group first.
3. **Gateway CPU**: every client closed and the anchor shut down, the cluster is left
   alone for ``NBOS_BENCH_GATEWAY_SETTLE_S`` seconds (default 15: longer than the fronts'
   wait before they back their pings off), then the gateway process's own CPU time (user
   and system, every thread: ``/proc/PID/stat``, as ``bench/idle.py`` reads it) is taken
   over a window of ``NBOS_BENCH_GATEWAY_WINDOW_S`` seconds (default 20), in % of one
   core. The gateway is a process of its own, so nothing of this benchmark counts towards
   it; the agents and the replicas are shown apart. The clock tick is the resolution.

Goal (issue 8): the gateway's CPU with 50 idle kernels under 5% of one core. The last
line is the JSON summary: the cell's p50 round trip through the gateway with N live
kernels against the same cell on one embedded kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from _measure import (
    Group,
    children,
    connect,
    descendants,
    measure_cpu,
    memory_kib,
    pct,
    run_cell,
    started_at,
)
from jupyter_client.asynchronous.client import AsyncKernelClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nbos
from nbos.cli._progress import progress_bar
from nbos.gateway.control_api import KernelInfo, StartKernel, call
from nbos.transport.ports import free_loopback_ports
from tests.gateway._http import stop
from tests.gateway._service import start_gateway, status_when

if TYPE_CHECKING:
    from tqdm import tqdm

MAX_KERNELS = 200
KERNELS = (
    int(sys.argv[1])
    if len(sys.argv) > 1
    else int(os.environ.get("NBOS_BENCH_GATEWAY_KERNELS", "50"))
)
PARALLEL = int(os.environ.get("NBOS_BENCH_GATEWAY_PARALLEL", "2"))
CELLS = int(os.environ.get("NBOS_BENCH_GATEWAY_CELLS", "200"))
BLOCK = int(os.environ.get("NBOS_BENCH_BLOCK", "20"))
PASSES = int(os.environ.get("NBOS_BENCH_GATEWAY_PASSES", "2"))
SETTLE_S = float(os.environ.get("NBOS_BENCH_GATEWAY_SETTLE_S", "15"))
WINDOW_S = float(os.environ.get("NBOS_BENCH_GATEWAY_WINDOW_S", "20"))
HOSTS = 3
CELL = "pass"
WARMUP = 10
START_TIMEOUT_S = 300.0
MIN_AVAILABLE_MIB = 2048
# How long the gateway's processes may take to end after it did.
LINGER_S = 30.0


def available_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def ms(seconds: Sequence[float], q: float | None = None) -> float:
    """p50 (``q`` None) or the ``q`` percentile of ``seconds``, in ms."""
    samples = list(seconds)
    return 1000 * (statistics.median(samples) if q is None else pct(samples, q))


def advance(bar: tqdm[None] | None, done: int, total: int, what: str) -> None:
    """One more done: the bar on a terminal, else a line at every tenth of the way."""
    if bar is not None:
        bar.update()
    elif done % max(1, total // 10) == 0 or done == total:
        print(f"  {done}/{total} {what}", flush=True)


async def start_kernels(control: str) -> tuple[list[KernelInfo], list[float], float]:
    """N kernels through the control API: their infos, each start's seconds, the phase's."""
    infos: list[KernelInfo] = []
    times: list[float] = []
    limit = anyio.Semaphore(PARALLEL)

    async def one(bar: tqdm[None] | None) -> None:
        async with limit:
            if available_mib() < MIN_AVAILABLE_MIB:
                raise SystemExit(
                    f"stopped after {len(infos)} kernels: under {MIN_AVAILABLE_MIB} MiB of memory "
                    "left; run with fewer (NBOS_BENCH_GATEWAY_KERNELS)"
                )
            begun = time.perf_counter()
            info = await call(control, StartKernel(), timeout=START_TIMEOUT_S)
            if not isinstance(info, KernelInfo):
                raise SystemExit(f"the gateway did not start a kernel: {info}")
            times.append(time.perf_counter() - begun)
            infos.append(info)
            advance(bar, len(infos), KERNELS, "kernels started")

    begun = time.perf_counter()
    with progress_bar(KERNELS, "starting kernels", "kernel") as bar:
        async with anyio.create_task_group() as tg:
            for _ in range(KERNELS):
                tg.start_soon(one, bar)
    return infos, times, time.perf_counter() - begun


async def one_vs_anchor(
    gateway: AsyncKernelClient, anchor: AsyncKernelClient
) -> dict[str, list[float]]:
    """The cell on one gateway kernel and on the anchor, alternating in blocks."""
    series: dict[str, list[float]] = {"gateway": [], "anchor": []}
    clients = {"gateway": gateway, "anchor": anchor}
    for client in clients.values():
        for _ in range(WARMUP):
            await run_cell(client, CELL)
    order = list(clients)
    with progress_bar(2 * CELLS, "one kernel vs the anchor", "cell") as bar:
        while len(series["anchor"]) < CELLS:
            for name in order:
                for _ in range(min(BLOCK, CELLS - len(series[name]))):
                    series[name].append((await run_cell(clients[name], CELL))[0])
                    done = len(series["gateway"]) + len(series["anchor"])
                    advance(bar, done, 2 * CELLS, "cells, one kernel vs the anchor")
            order.reverse()  # so neither always runs right after the other
    return series


async def round_robin(clients: Sequence[AsyncKernelClient]) -> list[float]:
    """One untimed pass over every kernel, then ``PASSES`` timed ones."""
    for client in clients:
        await run_cell(client, CELL)
    times: list[float] = []
    with progress_bar(PASSES * len(clients), "round-robin over the kernels", "cell") as bar:
        for _ in range(PASSES):
            for client in clients:
                times.append((await run_cell(client, CELL))[0])
                advance(bar, len(times), PASSES * len(clients), "cells round-robin")
    return times


async def cells(infos: Sequence[KernelInfo]) -> tuple[dict[str, list[float]], list[float]]:
    """Phase 2; every client and the anchor are gone when it returns."""
    clients = [await connect(dict(info.connection)) for info in infos]
    try:
        async with nbos.LocalCluster(hosts=HOSTS) as cluster:
            kernel = await cluster.start_kernel()
            anchor = await connect(kernel.connection_info)
            try:
                series = await one_vs_anchor(clients[0], anchor)
            finally:
                anchor.stop_channels()
        return series, await round_robin(clients)
    finally:
        for client in clients:
            client.stop_channels()


async def measure(control: str, gateway_pid: int) -> dict[str, object]:
    infos, starts, phase_s = await start_kernels(control)
    print(
        f"starts: {KERNELS} kernels in {phase_s:.1f} s, {KERNELS / phase_s:.2f} kernels/s "
        f"({PARALLEL} in flight); one start p50 {statistics.median(starts):.2f} s, "
        f"max {max(starts):.2f} s",
        flush=True,
    )
    show_memory(infos, gateway_pid)
    series, spread = await cells(infos)
    for name, label in (
        ("gateway", f"gateway, 1 of {KERNELS} live kernels"),
        ("anchor", "embedded (anchor)"),
    ):
        print(f"  {label:34}: p50 {ms(series[name]):7.2f} ms  p99 {ms(series[name], 0.99):7.2f} ms")
    print(
        f"  {f'gateway, round-robin over {KERNELS}':34}: p50 {ms(spread):7.2f} ms  "
        f"p99 {ms(spread, 0.99):7.2f} ms  ({len(spread)} cells)",
        flush=True,
    )
    await anyio.sleep(SETTLE_S)
    agents = children(gateway_pid)
    groups = [
        Group("gateway", {gateway_pid}),
        Group("agents", agents),
        Group("replicas", descendants(gateway_pid) - agents - {gateway_pid}),
    ]
    cpu = await anyio.to_thread.run_sync(measure_cpu, groups, WINDOW_S)
    show_cpu(cpu, groups)
    return {
        "bench": "gateway",
        "metric": f"trivial cell p50 round trip through nbos gateway with {KERNELS} live kernels",
        "unit": "ms",
        "value": round(ms(series["gateway"]), 3),
        "anchor": "the same cell on one embedded kernel (LocalCluster), same run",
        "anchor_value": round(ms(series["anchor"]), 3),
        "ratio": round(ms(series["gateway"]) / ms(series["anchor"]), 3),
        "better": "lower",
    }


def show_memory(infos: Sequence[KernelInfo], gateway_pid: int) -> None:
    rss = pss = 0
    for replica in infos[0].replicas:
        if replica.pid is not None:
            r, p = memory_kib(replica.pid)
            rss, pss = rss + r, pss + p
    gw_rss, gw_pss = memory_kib(gateway_pid)
    print(
        f"memory: one kernel's replicas RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB; "
        f"the gateway process RSS {gw_rss / 1024:.0f} MiB, PSS {gw_pss / 1024:.0f} MiB; "
        f"{available_mib()} MiB still available",
        flush=True,
    )


def show_cpu(cpu: dict[str, float], groups: Sequence[Group]) -> None:
    sizes = {g.name: len(g.pids) for g in groups}
    print(
        f"idle CPU over {WINDOW_S:g} s after {SETTLE_S:g} s of quiet (resolution "
        f"{100 / os.sysconf('SC_CLK_TCK') / WINDOW_S:.3f}% of a core), % of one core:"
    )
    print(f"  the gateway process, {KERNELS} idle kernels: {cpu['gateway']:.3f}% (goal: under 5%)")
    print(f"  its {sizes['agents']} agents: {cpu['agents']:.3f}%")
    print(f"  the {sizes['replicas']} processes below them (replicas): {cpu['replicas']:.3f}%")


def main() -> None:
    if not 1 <= KERNELS <= MAX_KERNELS:
        raise SystemExit(f"N (NBOS_BENCH_GATEWAY_KERNELS) is {KERNELS}: from 1 to {MAX_KERNELS}")
    print(
        f"{KERNELS} kernels on one `nbos gateway` ({HOSTS} local agents); anchor: one embedded "
        f"kernel on LocalCluster(hosts={HOSTS}); cell {CELL!r}; {os.cpu_count()} CPUs",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="nbos-bench-gateway-") as tmp:
        control, agents = free_loopback_ports(2)
        env = {
            "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
            "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
            # A loaded machine must not make the agents look gone.
            "NBOS_GATEWAY__MISSED_HEARTBEATS": "30",
            "NBOS_CLUSTER__HOSTS": str(HOSTS),
            "NBOS_CLUSTER__DATA_DIR": str(Path(tmp) / "run"),
        }
        log = Path(tmp) / "gateway.log"
        gateway = start_gateway(env, log)
        address = f"127.0.0.1:{control}"
        try:
            summary = anyio.run(ready_then_measure, address, gateway.pid)
        finally:
            stop_cluster(gateway, log)
    print(json.dumps(summary))


def stop_cluster(gateway: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM to the gateway, which stops its kernels and agents; SIGKILL to any of them
    still there a while after (the agents run in sessions of their own, so they would
    outlive a gateway that had to be killed). Notes go to stderr: stdout ends in JSON."""
    cluster = {pid: started_at(pid) for pid in descendants(gateway.pid) - {gateway.pid}}
    stop(gateway)
    if gateway.returncode == -signal.SIGKILL:
        print("the gateway did not stop on SIGTERM in time: killed", file=sys.stderr)
    deadline = time.monotonic() + LINGER_S
    while True:
        left = [p for p, t in cluster.items() if t is not None and started_at(p) == t]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        print(f"{len(left)} processes outlived the gateway: killed; its log ends:", file=sys.stderr)
        print("\n".join(log.read_text().splitlines()[-20:]), file=sys.stderr)


async def ready_then_measure(address: str, gateway_pid: int) -> dict[str, object]:
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == HOSTS)
    return await measure(address, gateway_pid)


if __name__ == "__main__":
    main()
