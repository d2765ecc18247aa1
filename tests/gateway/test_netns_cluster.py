"""The cluster across machines, for real on one: 4 hosts and the gateway in network namespaces.

Each host is a namespace with its own address and an ``nbos agent`` (CURVE keys);
``nbos gateway`` runs in a fifth, with its control API and kernel fronts at its own
address, and a client there drives it. Replicas bind their hosts' addresses, so
Raft and front traffic crosses the bridge. A host whose agent and replicas are
``kill -9``ed, or cut off with iptables, is suspected and its replica is replaced on the
spare host, state intact; a cut-off host that comes back has its stale replica stopped.
The gateway ``kill -9``ed and started again takes back every kernel, state intact; with
one GPU in the cluster, two clients' cells take turns on it, the second shown waiting;
``nbos chaos --gateway`` cuts hosts off with the test's iptables commands.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from nbos.transport.keys import generate_keys
from tests._servers._process import stop_process
from tests._servers.netns import Netns, netns_or_skip
from tests.agent._daemons import DEADLINE, ROOT, AgentProcess, alive, end_replicas, start_agent
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


@pytest.fixture
def host_gpus() -> dict[str, int]:
    """The virtual GPUs of each host's agent (a test may parametrize it)."""
    return dict.fromkeys(HOSTS, 2)


@attrs.define
class Cluster:
    """The gateway and 4 agents in their namespaces, a client, and a kernel with ``x = 40``
    whose cells take a GPU by default (none where some host has none)."""

    net: Netns
    agents: dict[str, AgentProcess]
    ask: Client
    kernel: dict[str, Any]
    gateway: subprocess.Popen[bytes]
    start_gateway: Callable[[], subprocess.Popen[bytes]]

    def restart_gateway(self) -> None:
        """SIGKILL the gateway process (nothing else), then start it on the same settings."""
        self.gateway.kill()
        self.gateway.wait()
        self.gateway = self.start_gateway()

    async def replaced(self, victim: str) -> dict[str, Any]:
        """The status once 3 replicas are alive again, none on ``victim``; checks where."""

        def done(status: dict[str, Any]) -> bool:
            alive = _alive(status)
            return len(alive) == 3 and victim not in {r["host"] for r in alive}

        status = await self.ask.status_when(done)
        assert {h["host_id"]: h["state"] for h in status["hosts"]}[victim] == "suspected"
        hosts = {r["host"] for r in _alive(status)}
        assert hosts == set(HOSTS) - {victim}
        # Each replica listens at its own host's address, as its connection file says.
        assert {r["ip"] for r in _alive(status)} == {self.net.address(h) for h in hosts}
        return status


@pytest.fixture
async def cluster(tmp_path: Path, net: Netns, host_gpus: dict[str, int]) -> AsyncIterator[Cluster]:
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

    def start() -> subprocess.Popen[bytes]:
        process = start_gateway(env, tmp_path / "gateway.log", lambda argv: net.argv("gw", argv))
        net.processes.append(process)  # the harness stops it, by PID
        return process

    gateway = start()
    agents: dict[str, AgentProcess] = {}
    made: Cluster | None = None
    try:
        for host in HOSTS:
            agents[host] = start_agent(
                host,
                f"{gw}:7071",
                tmp_path,
                address=f"{net.address(host)}:7001",
                keys=keys,
                where=lambda argv, host=host: net.argv(host, argv),
                gpus=host_gpus[host],
            )
            net.processes.append(agents[host].process)
        async with client(net, f"{gw}:7070", tmp_path / "client.log") as ask:
            await ask.status_when(lambda s: sum(h["state"] == "up" for h in s["hosts"]) == 4)
            kernel = await ask(op="start", gpus=min(1, *host_gpus.values()))
            assert "kernel_id" in kernel, kernel
            ips = {r["ip"] for r in kernel["replicas"]}
            assert len(ips) == 3 and ips <= {net.address(h) for h in HOSTS}
            assert kernel["connection"]["ip"] == gw  # the front listens at the gateway's
            assert await ask(op="cell", code="x = 40") == {"status": "ok", "stdout": ""}
            made = Cluster(net, agents, ask, kernel, gateway, start)
            yield made
    finally:
        # The gateway first, its kernels shut down through their agents while they run.
        stop_process(made.gateway if made else gateway, 3 * DEADLINE)
        for agent in agents.values():
            agent.kill()
            agent.wait()
            end_replicas(agent.state_dir)


@pytest.mark.long
async def test_a_host_killed_with_its_replicas_has_its_replica_replaced_state_intact(
    cluster: Cluster,
) -> None:
    victim = cluster.kernel["replicas"][0]["host"]
    agent = cluster.agents[victim]
    agent.kill()
    agent.wait()
    end_replicas(agent.state_dir)
    await cluster.replaced(victim)
    assert await cluster.ask(op="cell", code="print(x + 2)") == {"status": "ok", "stdout": "42\n"}


@pytest.mark.long  # over a minute; `make test` keeps the kill and the chaos cut
async def test_a_host_cut_off_is_replaced_and_its_replica_stopped_when_it_returns(
    cluster: Cluster,
) -> None:
    (cut,) = [r for r in cluster.kernel["replicas"] if r["node"] == 2]
    cluster.net.partition(cut["host"])
    await cluster.replaced(cut["host"])
    assert await cluster.ask(op="cell", code="print(x + 2)") == {"status": "ok", "stdout": "42\n"}
    assert alive(cut["pid"])  # cut off, not dead: it ran on unseen

    cluster.net.heal(cut["host"])
    # Back: the host registers again and the replica given up for lost is stopped.
    await cluster.ask.status_when(
        lambda s: {h["host_id"]: h["state"] for h in s["hosts"]}[cut["host"]] == "up"
    )
    with anyio.fail_after(DEADLINE):
        while alive(cut["pid"]):  # noqa: ASYNC110 (another process's state)
            await anyio.sleep(0.1)
    assert await cluster.ask(op="cell", code="print(x)") == {"status": "ok", "stdout": "40\n"}


async def test_the_gateway_killed_and_started_again_takes_every_kernel_back(
    cluster: Cluster,
) -> None:
    second = await cluster.ask(op="start", gpus=1)
    assert await cluster.ask(op="cell", code="y = 2") == {"status": "ok", "stdout": ""}
    kernels = {cluster.kernel["kernel_id"]: cluster.kernel, second["kernel_id"]: second}
    replicas = [r["pid"] for k in kernels.values() for r in k["replicas"]]

    cluster.restart_gateway()
    assert all(alive(p) for p in replicas)  # the agents kept them
    status = await cluster.ask.status_when(
        lambda s: sum(h["state"] == "up" for h in s["hosts"]) == 4 and len(_alive(s)) == 6
    )
    assert {k["kernel_id"]: k["connection"] for k in status["kernels"]} == {
        k: v["connection"] for k, v in kernels.items()
    }
    assert sorted(r["pid"] for r in _alive(status)) == sorted(replicas)
    # The clients' connection info holds: the same ports and key, the state intact.
    first = cluster.kernel["kernel_id"]
    assert await cluster.ask(op="cell", code="print(x + 2)", kernel=first) == {
        "status": "ok",
        "stdout": "42\n",
    }
    assert await cluster.ask(op="cell", code="print(y + 40)") == {"status": "ok", "stdout": "42\n"}


async def _usage_when(watch: Client, ready: Callable[[list[dict[str, Any]]], bool]) -> None:
    """Poll the gateway's usage until ``ready`` accepts its cells of one GPU."""
    with anyio.fail_after(4 * DEADLINE):
        while True:
            usage = await watch(op="usage")
            if ready([c for c in usage["cells"] if c["gpus"] == 1]):
                return
            await anyio.sleep(0.2)


@pytest.mark.parametrize("host_gpus", [{"a": 1, "b": 0, "c": 0, "d": 0}])
async def test_two_clients_contend_for_the_one_gpu_and_the_second_waits_with_a_status_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    """One GPU in the cluster, on host a: another client's 1-GPU cell waits for it, with
    nbos's status line, while the first client's cell holds it, and runs once it ends."""
    address = f"{cluster.net.address('gw')}:7070"
    release = tmp_path / "release"
    holds = f"while not os.path.exists({str(release)!r}): time.sleep(0.05)"
    cells = {
        "first": f"%%gpus 1\nimport os, time\n{holds}\nprint(time.time())",
        "second": "%%gpus 1\nimport time\nprint(time.time())",
    }
    first = cluster.kernel["kernel_id"]
    results: dict[str, Any] = {}
    async with (
        client(cluster.net, address, tmp_path / "client-2.log") as other,
        client(cluster.net, address, tmp_path / "client-3.log") as watch,
    ):
        second = (await other(op="start", gpus=0))["kernel_id"]

        async def run(name: str, ask: Client) -> None:
            results[name] = await ask(op="cell", code=cells[name], shown=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "first", cluster.ask)
            await _usage_when(watch, lambda cs: any(c["kernel_id"] == first for c in cs))
            tg.start_soon(run, "second", other)
            await _usage_when(watch, lambda cs: any(c["kernel_id"] == second for c in cs))
            release.touch()
        usage = {c["kernel_id"]: c for c in (await watch(op="usage"))["cells"] if c["gpus"] == 1}

    assert results["first"]["status"] == results["second"]["status"] == "ok", results
    assert not results["first"]["shown"]  # the GPU was idle: no waiting
    shown = results["second"]["shown"]
    assert shown[0].startswith("nbos: the cell waits: waiting for 1 GPUs"), shown
    assert shown[-1].startswith("nbos: the cell started after waiting"), shown
    # It ran after the first cell had ended and given the GPU back, not before.
    assert float(results["second"]["stdout"]) >= float(results["first"]["stdout"])
    assert usage[second]["started"] >= usage[first]["ended"]


@pytest.mark.long
async def test_chaos_cuts_a_host_off_with_the_users_commands_and_every_check_holds(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``nbos chaos --gateway`` in the gateway's namespace, ``partition-host`` carried out
    by scripts of the test's that put iptables rules into a host's namespace."""
    commands = {}
    for action in ("cut", "heal"):
        rules = {h: cluster.net.cut_commands(h, heal=action == "heal") for h in HOSTS}
        cases = [f"  {h}) {' && '.join(map(shlex.join, rules[h]))} ;;" for h in HOSTS]
        script = tmp_path / f"{action}.sh"
        script.write_text("\n".join(['case "$1" in', *cases, "  *) exit 2 ;;", "esac", ""]))
        commands[action] = f"sh {script} {{host}}"
    argv = [sys.executable, "-m", "nbos", "chaos", "--gateway", f"{cluster.net.address('gw')}:7070"]
    argv += ["--nemesis", "partition-host", "--partition-command", commands["cut"]]
    argv += ["--heal-command", commands["heal"], "--max-faults", "2", "--seed", "4"]
    argv += ["--duration", "600", "--run-dir", str(tmp_path)]
    with anyio.fail_after(10 * DEADLINE):
        done = await anyio.run_process(
            cluster.net.argv("gw", argv),
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    out = done.stdout.decode()
    assert done.returncode == 0, f"{out}\n{done.stderr.decode()[-5000:]}"
    struck = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [row[1:3] for row in struck] == [["partition-host", "host"]] * 2, out
