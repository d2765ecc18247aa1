"""The cluster across machines, for real on one: 4 hosts and the gateway in network namespaces.

Each host is a namespace with its own address and an ``nbos agent`` (CURVE keys);
``nbos gateway`` runs in a fifth, with its control API and kernel fronts at its own
address, and a client there drives it. Replicas bind their hosts' addresses, so
Raft and front traffic crosses the bridge. A host whose agent and replicas are
``kill -9``ed vanishes and its replica is replaced on the spare host, state intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from nbos.transport.keys import generate_keys
from tests._servers.netns import Netns, netns_or_skip
from tests.agent._daemons import DEADLINE, ROOT, AgentProcess, end_replicas, start_agent
from tests.gateway._service import start_gateway

pytestmark = pytest.mark.anyio

HOSTS = ["a", "b", "c", "d"]


@pytest.fixture
def net() -> Iterator[Netns]:
    yield from netns_or_skip(["gw", *HOSTS])


class Client:
    """The client process in the gateway's namespace (``_netns_client``)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self._process = process
        assert process.stdout is not None
        self._lines = BufferedByteReceiveStream(process.stdout)

    async def __call__(self, **command: Any) -> Any:
        assert self._process.stdin is not None
        await self._process.stdin.send((json.dumps(command) + "\n").encode())
        with anyio.fail_after(3 * DEADLINE):
            return json.loads(await self._lines.receive_until(b"\n", 1 << 24))

    async def status_when(self, ready: Any) -> Any:
        with anyio.fail_after(4 * DEADLINE):
            while not ready(status := await self(op="status")):  # noqa: ASYNC110 (polled)
                await anyio.sleep(0.5)
        return status


@asynccontextmanager
async def client(net: Netns, address: str, log: Path) -> AsyncIterator[Client]:
    argv = net.argv("gw", [sys.executable, "-m", "tests.gateway._netns_client", address])
    with log.open("ab") as stderr:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        yield Client(process)
    finally:
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()


def _alive(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for k in status["kernels"] for r in k["replicas"] if r["alive"]]


async def test_a_kernel_across_namespaces_survives_a_host_killed_with_its_replicas(
    tmp_path: Path, net: Netns
) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, HOSTS)
    gw = net.address("gw")
    env = {
        "NBOS_GATEWAY__ADDRESS": f"{gw}:7070",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"{gw}:7071",
        "NBOS_GATEWAY__KEYS": str(keys),
        "NBOS_GATEWAY__LOCAL_AGENTS": "false",
        "NBOS_GATEWAY__HEARTBEAT_S": "0.2",
        "NBOS_GATEWAY__MISSED_HEARTBEATS": "15",
        "NBOS_CLUSTER__DATA_DIR": str(tmp_path / "gateway"),
    }
    gateway = start_gateway(env, tmp_path / "gateway.log", lambda argv: net.argv("gw", argv))
    net.processes.append(gateway)  # stopped by the harness if the test fails
    agents: dict[str, AgentProcess] = {}
    try:
        for host in HOSTS:
            agents[host] = start_agent(
                host,
                f"{gw}:7071",
                tmp_path,
                address=f"{net.address(host)}:7001",
                keys=keys,
                where=lambda argv, host=host: net.argv(host, argv),
            )
            net.processes.append(agents[host].process)
        async with client(net, f"{gw}:7070", tmp_path / "client.log") as ask:
            await ask.status_when(lambda s: sum(h["state"] == "up" for h in s["hosts"]) == 4)
            kernel = await ask(op="start", gpus=1)
            assert "kernel_id" in kernel, kernel
            ips = {r["ip"] for r in kernel["replicas"]}
            assert len(ips) == 3 and ips <= {net.address(h) for h in HOSTS}
            assert kernel["connection"]["ip"] == gw
            assert await ask(op="cell", code="x = 40") == {"status": "ok", "stdout": ""}

            victim = kernel["replicas"][0]["host"]
            agents[victim].kill()
            agents[victim].wait()
            end_replicas(agents[victim].state_dir)

            def replaced(status: dict[str, Any]) -> bool:
                alive = _alive(status)
                return len(alive) == 3 and victim not in {r["host"] for r in alive}

            status = await ask.status_when(replaced)
            assert {h["host_id"]: h["state"] for h in status["hosts"]}[victim] == "vanished"
            hosts = {r["host"] for r in _alive(status)}
            assert hosts == set(HOSTS) - {victim}
            assert {r["ip"] for r in _alive(status)} == {net.address(h) for h in hosts}
            assert await ask(op="cell", code="print(x + 2)") == {"status": "ok", "stdout": "42\n"}
    finally:
        for agent in agents.values():
            agent.kill()
            agent.wait()
            end_replicas(agent.state_dir)
