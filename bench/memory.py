"""Memory of an idle kernel and a cluster's fixed cost: one ``nbos gateway`` vs a plain ipykernel.

Usage: ``python bench/memory.py``.

Memory is the proportional set size (PSS, ``/proc/PID/smaps_rollup``): a page shared by
``n`` processes counts ``1/n`` in each, so the PSS of all processes adds up to what they
take together. RSS (shared pages counted whole in each) and the private part (USS: pages
of that process only) are shown beside it.

* **Fixed cost**: the daemon ``python -m nbos gateway`` as a user starts it with no
  cluster file (3 local ``nbos agent`` processes of virtual GPUs, ``[agent]``
  settings from the environment, ``NBOS_AGENT__*``, as ``nbos gateway`` reads them),
  with no kernel, once every agent's pool of pre-started replicas is full and the
  process tree did not change for ``NBOS_BENCH_MEMORY_SETTLE_S`` seconds (default 10):
  the PSS of the gateway, its agents and everything below them (replica templates and
  pre-started replicas), by role. Goal (issue 31): at most 250 MiB.
* **An idle kernel**: one kernel started through the control API, one cell run, then
  ``NBOS_BENCH_MEMORY_SETTLE_S`` seconds of quiet: the PSS of its 3 replicas, against
  one idle plain ipykernel (the ``python3`` kernelspec started by
  :class:`jupyter_client.manager.AsyncKernelManager`, after one cell, no client left
  connected) measured in the same run. Its replicas share pages with the other
  processes of their hosts (a template, pre-started replicas), so their PSS depends on
  how many those are: the growth of the whole tree's PSS when the kernel came (the
  kernel's front in the gateway too, the pool's refill not counted) is shown as well.
  Goal (issue 31): at most 2x.

The last line is the JSON summary: the idle kernel's 3 replicas' PSS against the plain
ipykernel's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
from _measure import descendants
from jupyter_client.manager import AsyncKernelManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import stop_cluster
from nbos.gateway.control_api import KernelInfo, StartKernel, call
from nbos.transport.ports import free_loopback_ports
from tests.gateway._service import run_cell, start_gateway, status_when

HOSTS = 3
SETTLE_S = float(os.environ.get("NBOS_BENCH_MEMORY_SETTLE_S", "10"))
STEADY_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0
KIB = 1024


def smaps(pid: int) -> dict[str, int]:
    """RSS, PSS and USS (private) of ``pid`` in KiB; zeros for a process that is gone."""
    values = dict.fromkeys(("Rss", "Pss", "Private_Clean", "Private_Dirty"), 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0])
    except OSError:
        pass
    return {
        "rss": values["Rss"],
        "pss": values["Pss"],
        "uss": values["Private_Clean"] + values["Private_Dirty"],
    }


def total(pids: Iterable[int]) -> dict[str, int]:
    summed = {"rss": 0, "pss": 0, "uss": 0}
    for pid in pids:
        for key, value in smaps(pid).items():
            summed[key] += value
    return summed


def mib(kib: int) -> str:
    return f"{kib / KIB:.0f} MiB"


def line(name: str, pids: Iterable[int]) -> dict[str, int]:
    pids = list(pids)
    m = total(pids)
    print(
        f"  {name} ({len(pids)} processes): PSS {mib(m['pss'])}, RSS {mib(m['rss'])}, "
        f"USS {mib(m['uss'])}",
        flush=True,
    )
    return m


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def steady_tree(root: int) -> set[int]:
    """The processes below ``root`` once their set did not change for ``SETTLE_S``."""
    deadline = time.monotonic() + STEADY_TIMEOUT_S
    seen, since = descendants(root), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = descendants(root)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            return now
    raise SystemExit(f"the gateway's processes did not settle in {STEADY_TIMEOUT_S:g} s")


def fixed_cost(gateway: int) -> tuple[set[int], int]:
    """Print the tree's memory by role; its processes and total PSS."""
    tree = steady_tree(gateway)
    agents = {p for p in tree if " agent " in cmdline(p)}
    below = tree - agents - {gateway}
    templates = {p for p in below if "--template" in cmdline(p)}
    print("fixed cost, no kernel:")
    line("gateway", [gateway])
    line("agents", agents)
    if templates:
        line("replica templates", templates)
    line("pre-started replicas", below - templates)
    whole = line("all", tree)
    return tree, whole["pss"]


async def plain_ipykernel() -> tuple[AsyncKernelManager, set[int]]:
    manager = AsyncKernelManager(kernel_name="python3")
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=120)
        await client.execute_interactive("x = 1", timeout=120)
    finally:
        client.stop_channels()
    return manager, descendants(manager.provisioner.pid)  # type: ignore[union-attr]


async def measure(control: str, gateway: int) -> dict[str, object]:
    manager, plain = await plain_ipykernel()
    try:
        await status_when(control, lambda s: sum(h.state == "up" for h in s.hosts) == HOSTS)
        tree, before = await anyio.to_thread.run_sync(fixed_cost, gateway)
        info = await call(control, StartKernel(), timeout=START_TIMEOUT_S)
        if not isinstance(info, KernelInfo):
            raise SystemExit(f"the gateway did not start a kernel: {info}")
        reply = await run_cell(info, "x = 1")
        if reply.get("status") != "ok":
            raise SystemExit(f"the first cell failed: {reply}")
        await anyio.sleep(SETTLE_S)
        replicas = [r.pid for r in info.replicas if r.pid is not None]
        print("an idle kernel, after one cell:")
        ours = line("nbos, its 3 replicas", replicas)
        anchor = line("plain ipykernel", plain)
        # What came with the kernel: its replicas, and the tree's old processes' growth
        # (the gateway holds the kernel's front); the pool's refills are left out.
        grown = total(tree)["pss"] - before + ours["pss"]
        print(f"  growth of the gateway's tree's PSS with the kernel: {mib(grown)}")
        ratio = ours["pss"] / anchor["pss"]
        print(f"  replicas' PSS / ipykernel's PSS: {ratio:.2f}x (goal: at most 2x)")
        print(f"fixed cost: {mib(before)} PSS (goal: at most 250 MiB)")
    finally:
        await manager.shutdown_kernel(now=True)
    return {
        "bench": "memory",
        "metric": "PSS of an idle kernel's 3 replicas (after one cell)",
        "unit": "MiB",
        "value": round(ours["pss"] / KIB, 1),
        "anchor": "one idle plain ipykernel's PSS (after one cell), same run",
        "anchor_value": round(anchor["pss"] / KIB, 1),
        "ratio": round(ratio, 3),
        "better": "lower",
        "fixed_cost_mib": round(before / KIB, 1),
    }


def main() -> None:
    print(
        f"memory: `nbos gateway` ({HOSTS} local agents, NBOS_AGENT__* from the environment) "
        f"vs a plain ipykernel; {SETTLE_S:g} s settle; {os.cpu_count()} CPUs",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="nbos-bench-memory-") as tmp:
        control, agents = free_loopback_ports(2)
        env = {
            "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
            "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
            "NBOS_GATEWAY__MISSED_HEARTBEATS": "30",
            "NBOS_CLUSTER__HOSTS": str(HOSTS),
            "NBOS_CLUSTER__DATA_DIR": str(Path(tmp) / "run"),
        }
        log = Path(tmp) / "gateway.log"
        gateway = start_gateway(env, log)
        try:
            summary = anyio.run(measure, f"127.0.0.1:{control}", gateway.pid)
        finally:
            stop_cluster(gateway, log)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
