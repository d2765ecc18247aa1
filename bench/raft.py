"""nbos Raft vs pysyncobj: 3 node processes on loopback, commits/s and commit latency.

Every system runs as 3 processes speaking JSON lines with request ids on
stdin/stdout, and the same client drives them, always sending to the leader:

* ``nbos``: ``python -m nbos.raft.kv`` (the reference key-value store over
  :func:`nbos.raft.open_raft_log`), TCP transport (no keys), WAL with ``fsync=always``:
  entries, term and vote are fsynced before a node acknowledges or answers
  anything that depends on them (batched: one fsync per Ready), and so is
  every commit-index update. Also measured: ``fsync=batch``, which skips the
  sync of writes that only move the commit index (etcd's rule; the same
  guarantee for Raft's safety).
* ``pysyncobj`` (the anchor): this script in ``--pysyncobj-node`` mode, a
  :class:`pysyncobj.SyncObj` with a replicated dict, ``journalFile`` and
  ``fullDumpFile`` on disk. pysyncobj has no fsync option: its journal is an
  mmap that it never msyncs, which survives a process crash but not a power
  loss. For comparable durability the anchor wraps ``FileJournal.add`` to msync
  after every entry (pysyncobj has no group commit, so that is one msync per
  entry), measured with the default timing and with appends every 2 ms (the
  first has the higher throughput, the second the lower latency). Term and vote
  stay unsynced in every pysyncobj configuration.

For reference the run also measures the configurations that are *not*
durable against power loss: nbos with ``fsync=never`` and pysyncobj without
msync, both with its default timing (the leader sends appends every 100 ms) and
tuned (every 2 ms, the fastest setting found on loopback).

* throughput: ``NBOS_BENCH_CONCURRENCY`` proposers (default 64), each with one
  put in flight, for ``NBOS_BENCH_SECONDS`` (default 3) after a 1 s warm-up.
* latency: one proposer, sequential puts, ``NBOS_BENCH_LATENCY_OPS`` (default
  300) or ``LATENCY_BUDGET_S`` seconds, whichever ends first; p50 and p99.

The last line is the JSON summary: nbos (fsync=always) commits/s with concurrent
proposers against the better of the two durable pysyncobj configurations.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from nbos.raft.kv import NodeProcess, kv_node_argv
from nbos.transport.ports import free_loopback_ports

CONCURRENCY = int(os.environ.get("NBOS_BENCH_CONCURRENCY", "64"))
SECONDS = float(os.environ.get("NBOS_BENCH_SECONDS", "3"))
LATENCY_OPS = int(os.environ.get("NBOS_BENCH_LATENCY_OPS", "300"))
LATENCY_BUDGET_S = 2.0
WARMUP_S = 1.0
PYSYNCOBJ_TUNED = {"appendEntriesPeriod": 0.002, "autoTickPeriod": 0.001}
NODES = (1, 2, 3)
VALUE = "v" * 32

# --- the pysyncobj node (runs in a child process) --------------------------------------


def pysyncobj_node(
    self_address: str, partners: Sequence[str], data_dir: str, tuning: dict[str, Any]
) -> None:
    """A SyncObj with a replicated dict behind the same JSON-lines protocol as nbos.raft.kv.

    ``tuning`` holds SyncObjConf settings, and ``msync: True`` to make the journal
    durable: pysyncobj has no fsync option, so its ``FileJournal.add`` is wrapped
    to msync the journal after every entry it appends (before the node answers).
    """
    from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
    from pysyncobj.journal import FileJournal

    if tuning.pop("msync", False):
        add = FileJournal.add

        def add_durably(journal: Any, command: Any, idx: int, term: int) -> None:
            add(journal, command, idx, term)
            journal.flush()

        FileJournal.add = add_durably

    class Store(SyncObj):  # type: ignore[misc]
        def __init__(self) -> None:
            conf = SyncObjConf(
                journalFile=os.path.join(data_dir, "journal"),
                fullDumpFile=os.path.join(data_dir, "dump"),
                **tuning,
            )
            super().__init__(self_address, list(partners), conf)
            self.data: dict[str, str] = {}

        @replicated  # type: ignore[untyped-decorator]
        def put(self, key: str, value: str) -> str:
            self.data[key] = value
            return value

    lock = threading.Lock()

    def answer(reply: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    store = Store()
    answer({"ready": self_address})
    for line in sys.stdin:
        request = json.loads(line)
        rid = request.get("id")
        if request["op"] == "status":
            answer({"ok": True, "is_leader": store._isLeader(), "id": rid})
            continue

        def done(result: Any, error: Any, rid: Any = rid) -> None:
            ok = error == FAIL_REASON.SUCCESS
            answer({"ok": ok, "value": result, "error": None if ok else str(error), "id": rid})

        store.put(request["key"], request["value"], callback=done)


# --- the client ----------------------------------------------------------------------


class Cluster:
    """Three node processes of one system, and how to find its leader."""

    def __init__(
        self, name: str, nodes: list[NodeProcess], is_leader: Callable[[int, dict[str, Any]], bool]
    ) -> None:
        self.name = name
        self.nodes = nodes
        self._is_leader = is_leader

    async def leader(self, timeout: float = 20.0) -> NodeProcess:
        with anyio.fail_after(timeout):
            while True:
                for i, node in enumerate(self.nodes):
                    status = await node.request({"op": "status"}, timeout=1.0)
                    if status.get("ok") and self._is_leader(i, status):
                        return node
                await anyio.sleep(0.05)


def nbos_cluster(root: Path, name: str, fsync: str) -> Cluster:
    members = {
        n: f"tcp://127.0.0.1:{p}" for n, p in zip(NODES, free_loopback_ports(3), strict=True)
    }
    nodes = []
    for n in NODES:
        data = root / f"{name}-{n}"
        data.mkdir()
        argv = kv_node_argv(n, members, data, fsync=fsync, snapshot=10_000)
        nodes.append(NodeProcess(argv, stderr_path=root / f"{name}-{n}.stderr"))
    return Cluster(name, nodes, lambda i, s: s.get("leader") == NODES[i])


def pysyncobj_cluster(root: Path, name: str, tuning: dict[str, Any]) -> Cluster:
    addresses = [f"127.0.0.1:{p}" for p in free_loopback_ports(3)]
    nodes = []
    for i, address in enumerate(addresses):
        data = root / f"{name}-{i}"
        data.mkdir()
        partners = [a for a in addresses if a != address]
        argv = [sys.executable, __file__, "--pysyncobj-node", json.dumps(tuning), str(data)]
        argv += [address, *partners]
        nodes.append(NodeProcess(argv, stderr_path=root / f"{name}-{i}.stderr"))
    return Cluster(name, nodes, lambda i, s: bool(s.get("is_leader")))


async def throughput(leader: NodeProcess, seconds: float, concurrency: int) -> float:
    counts = [0] * concurrency
    seq = [0] * concurrency

    async def proposer(w: int, until: float) -> None:
        while time.perf_counter() < until:
            seq[w] += 1
            request = {
                "op": "put",
                "key": f"k{w}",
                "value": VALUE,
                "client": f"w{w}",
                "seq": seq[w],
            }
            reply = await leader.request(request, timeout=5.0)
            if reply.get("ok"):
                counts[w] += 1

    async def run(duration: float) -> int:
        until = time.perf_counter() + duration
        before = sum(counts)
        async with anyio.create_task_group() as tg:
            for w in range(concurrency):
                tg.start_soon(proposer, w, until)
        return sum(counts) - before

    await run(WARMUP_S)
    start = time.perf_counter()
    done = await run(seconds)
    return done / (time.perf_counter() - start)


async def latency(leader: NodeProcess) -> list[float]:
    samples = []
    until = time.perf_counter() + LATENCY_BUDGET_S
    for i in range(LATENCY_OPS):
        start = time.perf_counter()
        if start > until:
            break
        request = {"op": "put", "key": "lat", "value": VALUE, "client": "lat", "seq": i + 1}
        reply = await leader.request(request, timeout=5.0)
        if reply.get("ok"):
            samples.append(time.perf_counter() - start)
    return samples


async def measure(cluster: Cluster) -> dict[str, float]:
    async with anyio.create_task_group() as tg:
        try:
            for node in cluster.nodes:
                await node.start(tg)
            leader = await cluster.leader()
            rate = await throughput(leader, SECONDS, CONCURRENCY)
            samples = sorted(await latency(leader))
        finally:
            for node in cluster.nodes:
                await node.stop()
    if len(samples) < 10:
        raise SystemExit(f"{cluster.name}: only {len(samples)} sequential puts succeeded")
    return {
        "commits_per_s": rate,
        "p50_ms": 1000 * statistics.median(samples),
        "p99_ms": 1000 * samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "latency_ops": len(samples),
    }


#: The durable pysyncobj configurations; the anchor is the best of them on each figure.
DURABLE_PYSYNCOBJ = ("pysyncobj-msync", "pysyncobj-msync-tuned")
SYSTEMS: list[tuple[str, Callable[[Path], Cluster]]] = [
    ("WAL fsync=always", lambda root: nbos_cluster(root, "nbos", "always")),
    (
        "WAL fsync=batch: no sync for commit-index-only writes",
        lambda root: nbos_cluster(root, "nbos-batch", "batch"),
    ),
    (
        "journal msynced per entry",
        lambda root: pysyncobj_cluster(root, "pysyncobj-msync", {"msync": True}),
    ),
    (
        "journal msynced per entry, appends every 2 ms",
        lambda root: pysyncobj_cluster(
            root, "pysyncobj-msync-tuned", {**PYSYNCOBJ_TUNED, "msync": True}
        ),
    ),
    ("not durable: WAL fsync=never", lambda root: nbos_cluster(root, "nbos-nosync", "never")),
    ("not durable: default config", lambda root: pysyncobj_cluster(root, "pysyncobj", {})),
    (
        "not durable: appends every 2 ms",
        lambda root: pysyncobj_cluster(root, "pysyncobj-tuned", PYSYNCOBJ_TUNED),
    ),
]


async def main() -> None:
    try:
        import pysyncobj  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench/raft.py needs pysyncobj as its anchor: pip install pysyncobj (the 'bench' extra)"
        ) from None
    results: dict[str, dict[str, float]] = {}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="nbos-bench-raft-") as tmp:
        for note, make in SYSTEMS:
            cluster = make(Path(tmp))
            results[cluster.name] = await measure(cluster)
            notes[cluster.name] = note
    report(results, notes)


def report(results: dict[str, dict[str, float]], notes: dict[str, str]) -> None:
    print(
        f"3 processes on loopback; {CONCURRENCY} concurrent proposers for {SECONDS:g} s "
        f"(commits/s), then one sequential proposer (commit latency)"
    )
    for name, r in results.items():
        print(
            f"{name:>21}: {r['commits_per_s']:7.0f} commits/s   latency p50 {r['p50_ms']:7.2f} ms"
            f"  p99 {r['p99_ms']:7.2f} ms  ({int(r['latency_ops'])} puts)   {notes[name]}"
        )
    durable = [results[name] for name in DURABLE_PYSYNCOBJ]
    best = {
        "commits_per_s": max(r["commits_per_s"] for r in durable),
        "p50_ms": min(r["p50_ms"] for r in durable),
    }
    pairs = (
        ("nbos", "best durable pysyncobj", best),
        ("nbos-batch", "best durable pysyncobj", best),
        ("nbos-nosync", "pysyncobj-tuned (neither durable)", results["pysyncobj-tuned"]),
    )
    for ours, name, theirs in pairs:
        a = results[ours]
        print(
            f"{ours} vs {name}: throughput {a['commits_per_s'] / theirs['commits_per_s']:.2f}x, "
            f"p50 latency {a['p50_ms']:.2f} ms vs {theirs['p50_ms']:.2f} ms"
        )
    nbos = results["nbos"]
    summary = {
        "bench": "raft",
        "metric": f"commits/s, 3 processes on loopback, {CONCURRENCY} concurrent proposers, "
        "durable (nbos fsync=always, pysyncobj journal msynced per entry)",
        "unit": "commits/s",
        "value": round(nbos["commits_per_s"], 1),
        "anchor": "pysyncobj",
        "anchor_value": round(best["commits_per_s"], 1),
        "ratio": round(nbos["commits_per_s"] / best["commits_per_s"], 3),
        "better": "higher",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pysyncobj-node":
        tuning, data_dir, address, *partners = sys.argv[2:]
        pysyncobj_node(address, partners, data_dir, json.loads(tuning))
    else:
        anyio.run(main)
