"""Client histories against 3 ``nbos.raft.kv`` processes under faults are linearizable.

Concurrent clients put, append and read (on any node: followers serve reads by
ReadIndex) two keys while the nemesis kills and pauses nodes. Each operation is
recorded with its invocation and completion times and its result, and the
whole history goes through the Wing & Gong checker in ``tests/linearizability.py``.
A write that never got an answer is recorded as of unknown outcome; a read
that got none is left out.

``NBOS_CHAOS_ROUNDS`` (default 6) sets the number of faults, ``NBOS_CHAOS_SEED``
(default 0) the nemesis and client choices; the history size
is bounded by ``NBOS_LIN_OPS`` operations per client (default 250).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

import anyio
import pytest

from tests.chaos.conftest import KvClient, KvCluster, Nemesis
from tests.linearizability import Operation, check

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

ROUNDS = int(os.environ.get("NBOS_CHAOS_ROUNDS", "6"))
SEED = int(os.environ.get("NBOS_CHAOS_SEED", "0"))
OPS_PER_CLIENT = int(os.environ.get("NBOS_LIN_OPS", "250"))
CLIENTS = 4
KEYS = ("x", "y")
WRITE_DEADLINE_S = 5.0
READ_DEADLINE_S = 2.0


async def client_loop(
    client: KvClient, rng: random.Random, history: list[Operation], stop: anyio.Event
) -> None:
    for n in range(OPS_PER_CLIENT):
        if stop.is_set():
            return
        kind, key = rng.choice(("put", "append", "get", "get")), rng.choice(KEYS)
        value = f"{client.client_id}.{n};"  # unique, so a read tells which writes it saw
        call = anyio.current_time()
        if kind == "get":
            via = rng.choice(client.cluster.ids)
            reply = await client.read(key, call + READ_DEADLINE_S, via=via)
            if reply is not None:
                ret = anyio.current_time()
                history.append(
                    Operation(client.client_id, call, ret, kind, key, output=reply["value"])
                )
            continue
        reply = await client.write(kind, key, value, call + WRITE_DEADLINE_S)
        if reply is None:
            history.append(
                Operation(client.client_id, call, math.inf, kind, key, value, known=False)
            )
            continue
        output = reply["size"] if kind == "append" else None
        ret = anyio.current_time()
        history.append(Operation(client.client_id, call, ret, kind, key, value, output))


async def test_history_under_faults_is_linearizable(
    tmp_path: Path, kv_processes: list[tuple[int, str]]
) -> None:
    cluster = KvCluster(tmp_path, 3, kv_processes)
    history: list[Operation] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        try:
            await cluster.start_all(tg)
            nemesis = Nemesis(cluster, tg, seed=SEED, load_s=0.3)
            async with anyio.create_task_group() as load:
                for c in range(CLIENTS):
                    client = KvClient(cluster, f"c{c}", attempt_timeout=0.5)
                    load.start_soon(client_loop, client, random.Random(SEED + c), history, stop)
                await nemesis.run(ROUNDS)
                stop.set()
        finally:
            await cluster.stop_all()
    reads = sum(1 for op in history if op.kind == "get")
    assert reads > 10, f"too few reads completed to say anything: {len(history)} operations"
    bad = check(history)
    if bad:
        dump = tmp_path / "history.json"
        dump.write_text(json.dumps([dataclasses.asdict(op) for op in history]))
        pytest.fail(f"keys {bad} not linearizable under {nemesis.log}; history in {dump}")
