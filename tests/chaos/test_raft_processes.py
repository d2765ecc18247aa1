"""Raft under faults: 3 and 5 ``nbos.raft.kv`` processes over ZeroMQ, fsync=always.

Clients append unique tokens (``client-seq;``) to a few keys while a nemesis
kill -9s the leader again and again (restarting it from its data directory),
SIGSTOPs a follower and once the leader, and restarts followers. Afterwards:

* every acknowledged token is in the final state exactly once, and a client's
  acknowledged tokens appear in the order they were acknowledged (no loss, no
  duplicate, no reordering of a client's writes);
* no token appears that was never sent, and none twice (retries apply once);
* all nodes converge to the same applied index and data.

``NBOS_CHAOS_ROUNDS`` (default 6) sets how many faults each test injects and
``NBOS_CHAOS_SEED`` (default 0) which victims and pauses the nemesis picks.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from tests.chaos.conftest import KvClient, KvCluster, Nemesis

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

ROUNDS = int(os.environ.get("NBOS_CHAOS_ROUNDS", "6"))
SEED = int(os.environ.get("NBOS_CHAOS_SEED", "0"))
CLIENTS = 3
KEYS = 2
LOAD_BETWEEN_FAULTS_S = 0.4
WRITE_DEADLINE_S = 20.0


class Ledger:
    """What the clients sent and what was acknowledged, per client in ack order."""

    def __init__(self) -> None:
        self.acked: dict[str, list[str]] = {}
        self.sent: set[str] = set()


async def writer(client: KvClient, key: str, ledger: Ledger, stop: anyio.Event) -> None:
    acked = ledger.acked.setdefault(client.client_id, [])
    while not stop.is_set():
        token = f"{client.client_id}-{client.seq + 1}"
        ledger.sent.add(token)
        deadline = anyio.current_time() + WRITE_DEADLINE_S
        if await client.write("append", key, token + ";", deadline) is not None:
            acked.append(token)


def check_history(data: dict[str, str], ledger: Ledger, nemesis_log: list[str]) -> None:
    where = f"(faults: {nemesis_log})"
    found: dict[str, tuple[str, int]] = {}
    for key, value in data.items():
        if not key.startswith("k"):
            continue
        for position, token in enumerate(t for t in value.split(";") if t):
            assert token not in found, f"token {token} applied twice {where}"
            assert token in ledger.sent, f"token {token} was never sent {where}"
            found[token] = (key, position)
    for client, tokens in ledger.acked.items():
        missing = [t for t in tokens if t not in found]
        assert not missing, f"acknowledged writes lost: {missing} {where}"
        positions = [found[t][1] for t in tokens]
        assert positions == sorted(positions), f"{client}'s writes reordered {where}"


async def run_chaos(tmp_path: Path, kv_processes: list[tuple[int, str]], size: int) -> None:
    cluster = KvCluster(tmp_path, size, kv_processes)
    ledger = Ledger()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        try:
            await cluster.start_all(tg)
            nemesis = Nemesis(cluster, tg, seed=SEED + size, load_s=LOAD_BETWEEN_FAULTS_S)
            async with anyio.create_task_group() as load:
                for c in range(CLIENTS):
                    client = KvClient(cluster, f"c{c}")
                    load.start_soon(writer, client, f"k{c % KEYS}", ledger, stop)
                await nemesis.run(ROUNDS)
                stop.set()
            # every node back and running; one more write proves the group is live
            for node in list(cluster.paused):
                cluster.resume(node)
            for node in cluster.ids:
                if not cluster.nodes[node].alive:
                    await cluster.start(tg, node)
            barrier = KvClient(cluster, "barrier")
            deadline = anyio.current_time() + WRITE_DEADLINE_S
            done = await barrier.write("put", "barrier", "done", deadline)
            assert done is not None, "no leader after faults"
            data = await cluster.converged()
        finally:
            await cluster.stop_all()
    assert data["barrier"] == "done"
    acked = sum(len(tokens) for tokens in ledger.acked.values())
    assert acked >= ROUNDS, f"only {acked} writes acknowledged through {nemesis.log}"
    check_history(data, ledger, nemesis.log)


async def test_three_processes_survive_leader_kills_and_pauses(
    tmp_path: Path, kv_processes: list[tuple[int, str]]
) -> None:
    await run_chaos(tmp_path, kv_processes, 3)


async def test_five_processes_survive_leader_kills_and_pauses(
    tmp_path: Path, kv_processes: list[tuple[int, str]]
) -> None:
    await run_chaos(tmp_path, kv_processes, 5)
