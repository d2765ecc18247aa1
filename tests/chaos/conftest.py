"""Fixtures for the chaos tests: real ``nbos.raft.kv`` node processes over ZeroMQ on loopback.

Every process a test starts is recorded by PID; the ``kv_processes`` finalizer
SIGKILLs whichever of them is still alive, whatever way the test ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from nbos.raft.kv import NodeProcess, kv_node_argv


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class KvCluster:
    """``size`` node processes, one data directory each, restartable from it."""

    def __init__(
        self, root: Path, size: int, spawned: list[tuple[int, str]], *, snapshot: int = 200
    ) -> None:
        self.ids = list(range(1, size + 1))
        self.root = root
        self.members = {
            n: f"tcp://127.0.0.1:{port}" for n, port in zip(self.ids, free_ports(size), strict=True)
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

    async def write(self, op: str, key: str, value: str, deadline: float) -> bool:
        self.seq += 1
        request = {"op": op, "key": key, "value": value, "client": self.client_id, "seq": self.seq}
        reply = await self._call(request, deadline)
        return reply is not None

    async def read(self, key: str, deadline: float) -> tuple[bool, str | None]:
        reply = await self._call({"op": "get", "key": key}, deadline)
        return (False, None) if reply is None else (True, reply["value"])

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
