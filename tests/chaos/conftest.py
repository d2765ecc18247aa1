"""Fixtures for the chaos tests: real ``nbos.raft.kv`` node processes over ZeroMQ on loopback.

Every process a test starts is recorded by PID; the ``kv_processes`` finalizer
SIGKILLs whichever of them is still alive, whatever way the test ended.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from nbos.raft.kv import NodeProcess, kv_node_argv
from nbos.transport.ports import free_loopback_ports


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class KvCluster:
    """``size`` node processes, one data directory each, restartable from it."""

    def __init__(
        self, root: Path, size: int, spawned: list[tuple[int, str]], *, snapshot: int = 200
    ) -> None:
        self.ids = list(range(1, size + 1))
        self.root = root
        self.members = {
            n: f"tcp://127.0.0.1:{port}"
            for n, port in zip(self.ids, free_loopback_ports(size), strict=True)
        }
        self.nodes: dict[int, NodeProcess] = {}
        self._spawned = spawned
        for n in self.ids:
            (root / str(n)).mkdir()
            # a small snapshot interval so restarts also go through snapshot recovery
            argv = kv_node_argv(n, self.members, root / str(n), fsync="always", snapshot=snapshot)
            self.nodes[n] = NodeProcess(argv, stderr_path=root / f"{n}.stderr")
        self.paused: set[int] = set()

    async def start(self, tg: TaskGroup, node: int) -> None:
        await self.nodes[node].start(tg)
        pid = self.nodes[node].pid
        assert pid is not None
        self._spawned.append((pid, str(self.root / str(node))))

    async def start_all(self, tg: TaskGroup) -> None:
        async with anyio.create_task_group() as starting:
            for n in self.ids:
                starting.start_soon(self.start, tg, n)

    async def kill(self, node: int) -> None:
        """kill -9, and reap."""
        self.paused.discard(node)
        await self.nodes[node].stop()

    async def restart(self, tg: TaskGroup, node: int) -> None:
        await self.kill(node)
        await self.start(tg, node)

    def pause(self, node: int) -> None:
        self.nodes[node].pause()
        self.paused.add(node)

    def resume(self, node: int) -> None:
        self.nodes[node].resume()
        self.paused.discard(node)

    async def stop_all(self) -> None:
        for node in self.nodes.values():
            await node.stop()

    async def leader(self, timeout: float = 15.0) -> int:
        """A node that says it leads (asked of the running, unpaused nodes)."""
        with anyio.fail_after(timeout):
            while True:
                for n in self.ids:
                    if n in self.paused or not self.nodes[n].alive:
                        continue
                    status = await self.nodes[n].request({"op": "status"}, timeout=0.5)
                    if status.get("ok") and status.get("leader") == n:
                        return n
                await anyio.sleep(0.05)

    async def statuses(self) -> dict[int, dict[str, Any]]:
        return {n: await self.nodes[n].request({"op": "status"}, timeout=2.0) for n in self.ids}

    async def converged(self, timeout: float = 20.0) -> dict[str, str]:
        """Wait until every node reports the same applied index and data; return the data."""
        statuses: dict[int, dict[str, Any]] = {}
        with anyio.move_on_after(timeout):
            while True:
                statuses = await self.statuses()
                answers = list(statuses.values())
                if all(s.get("ok") for s in answers) and all(
                    (s["applied"], s["data"]) == (answers[0]["applied"], answers[0]["data"])
                    for s in answers
                ):
                    data: dict[str, str] = answers[0]["data"]
                    return data
                await anyio.sleep(0.1)
        summary = {n: (s.get("applied"), s.get("error")) for n, s in statuses.items()}
        raise AssertionError(f"nodes did not converge within {timeout}s: {summary}")


class KvClient:
    """One client: sequential requests, each retried on other nodes until it succeeds.

    A write carries ``(client, seq)`` and is retried with the same pair, so it
    applies once however many nodes it was sent to. ``write`` returns False when
    the deadline passed without an acknowledgement: its outcome is unknown.
    """

    def __init__(self, cluster: KvCluster, client_id: str, attempt_timeout: float = 1.0) -> None:
        self.cluster = cluster
        self.client_id = client_id
        self.seq = 0
        self.attempt_timeout = attempt_timeout
        self._target = cluster.ids[0]

    async def write(self, op: str, key: str, value: str, deadline: float) -> dict[str, Any] | None:
        """The node's answer, or None when the outcome is unknown."""
        self.seq += 1
        request = {"op": op, "key": key, "value": value, "client": self.client_id, "seq": self.seq}
        return await self._call(request, deadline)

    async def read(
        self, key: str, deadline: float, via: int | None = None
    ) -> dict[str, Any] | None:
        """A linearizable read, first asked of node ``via`` (a follower serves it by ReadIndex)."""
        if via is not None:
            self._target = via
        return await self._call({"op": "get", "key": key}, deadline)

    async def _call(self, request: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        while anyio.current_time() < deadline:
            reply = await self.cluster.nodes[self._target].request(
                request, timeout=self.attempt_timeout
            )
            if reply.get("ok"):
                return reply
            hint = reply.get("leader")
            if reply.get("error") == "NotLeaderError" and hint in self.cluster.nodes:
                if hint == self._target:  # a leader that just lost its place: let it settle
                    await anyio.sleep(0.02)
                self._target = hint
            else:
                ids = self.cluster.ids
                self._target = ids[(ids.index(self._target) + 1) % len(ids)]
                await anyio.sleep(0.01)
        return None


class Nemesis:
    """One fault a round, ``load_s`` apart; the faults cycle so that every kind happens."""

    def __init__(self, cluster: KvCluster, tg: TaskGroup, seed: int, load_s: float) -> None:
        self.cluster = cluster
        self.load_s = load_s
        self.tg = tg
        self.rng = random.Random(seed)
        self.log: list[str] = []

    async def run(self, rounds: int) -> None:
        schedule: list[Callable[[], Awaitable[None]]] = [
            self.kill_leader,
            self.pause_follower,
            self.kill_leader,
            self.pause_leader,
            self.restart_follower,
            self.kill_minority,
        ]
        for r in range(rounds):
            await anyio.sleep(self.load_s)
            await schedule[r % len(schedule)]()

    async def followers(self) -> tuple[int, list[int]]:
        leader = await self.cluster.leader()
        return leader, [n for n in self.cluster.ids if n != leader]

    async def kill_leader(self) -> None:
        leader = await self.cluster.leader()
        self.log.append(f"kill -9 leader {leader}")
        await self.cluster.kill(leader)
        await anyio.sleep(self.rng.uniform(0.2, 0.6))
        await self.cluster.start(self.tg, leader)

    async def pause_follower(self) -> None:
        _, followers = await self.followers()
        node = self.rng.choice(followers)
        self.log.append(f"SIGSTOP follower {node}")
        self.cluster.pause(node)
        await anyio.sleep(self.rng.uniform(0.5, 1.0))
        self.cluster.resume(node)

    async def pause_leader(self) -> None:
        leader = await self.cluster.leader()
        self.log.append(f"SIGSTOP leader {leader}")
        self.cluster.pause(leader)
        # long past the election timeout: the others elect a new leader meanwhile
        await anyio.sleep(1.0)
        self.cluster.resume(leader)

    async def restart_follower(self) -> None:
        _, followers = await self.followers()
        node = self.rng.choice(followers)
        self.log.append(f"restart follower {node}")
        await self.cluster.restart(self.tg, node)

    async def kill_minority(self) -> None:
        """kill -9 the leader and, with 5 nodes, one follower too; restart both."""
        leader, followers = await self.followers()
        victims = [leader, *self.rng.sample(followers, (len(self.cluster.ids) - 1) // 2 - 1)]
        self.log.append(f"kill -9 {victims}")
        for node in victims:
            await self.cluster.kill(node)
        await anyio.sleep(self.rng.uniform(0.2, 0.6))
        for node in victims:
            await self.cluster.start(self.tg, node)


@pytest.fixture
def kv_processes() -> Iterator[list[tuple[int, str]]]:
    """(PID, data dir) of every node process a test starts; SIGKILLs the live ones at teardown.

    A PID is signalled only while its command line still names its own data
    directory, so a PID the system has since given to another process is left alone.
    """
    spawned: list[tuple[int, str]] = []
    yield spawned
    for pid, marker in spawned:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline.split("\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
