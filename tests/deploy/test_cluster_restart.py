"""``nbos cluster up`` on a cluster that runs, ``restart`` and ``down``, with local hosts.

What runs is read from ``/proc``: every process whose command line or environment names
the test's directory is of its cluster (the gateway's settings name its data dir there,
the agents' state directories and the replicas' working directories are there). ``up``
twice runs one gateway and one agent per host; ``up`` after the gateway's ``kill -9``
starts a gateway only, which takes the kernel back; ``restart`` of the gateway or of a
host keeps the kernel and its state; ``down`` leaves no process of the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import attrs
import pytest

from nbos.deploy._up import RECORD
from nbos.gateway.control_api import KernelInfo, StartKernel
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import ROOT, alive
from tests.deploy.test_cluster_up import NBOS, nbos
from tests.gateway._http import call
from tests.gateway._service import ask, run_cell, status_when

# Gateway starts, agents and replicas, each a Python start: slow on a loaded machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

HOSTS = ("h1", "h2")
TOKEN = "cluster-secret"


@attrs.frozen
class Running:
    """The processes of one cluster, by what they are."""

    gateways: tuple[int, ...]
    agents: dict[str, int]
    replicas: frozenset[int]

    @property
    def pids(self) -> set[int]:
        return {*self.gateways, *self.agents.values(), *self.replicas}


def running(root: Path) -> Running:
    """What runs whose command line or environment names ``root`` (a /proc scan)."""
    needle = str(root).encode()
    gateways: list[int] = []
    agents: dict[str, int] = {}
    replicas: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # ended meanwhile
        if pid == os.getpid() or not alive(pid):
            continue
        if not any(needle in part for part in argv) and needle not in environ:
            continue
        if b"gateway" in argv:
            gateways.append(pid)
        elif b"agent" in argv:
            host = argv[argv.index(b"--host") + 1].decode()
            assert host not in agents, f"two agents of {host}: {agents[host]} and {pid}"
            agents[host] = pid
        else:
            replicas.add(pid)
    return Running(tuple(sorted(gateways)), agents, frozenset(replicas))


@attrs.frozen
class LocalCluster:
    """A cluster file of local hosts in a test's directory, and its gateway's address."""

    path: Path
    address: str
    #: The gateway's Kernel Gateway API (``jupyter lab --gateway-url``).
    url: str

    @property
    def root(self) -> Path:
        return self.path.parent


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    control, agents, http = free_loopback_ports(3)
    hosts = "".join(
        f"""
[[hosts]]
name = "{name}"
address = "127.0.0.1"
gpus = 1
command = {json.dumps(NBOS)}
env = {{ PYTHONPATH = "{ROOT}" }}
"""
        for name in HOSTS
    )
    path = tmp_path / "cluster.toml"
    path.write_text(
        f"""
[gateway]
address = "127.0.0.1:{control}"
agent_address = "127.0.0.1:{agents}"
heartbeat_s = 0.5
# A loaded machine may keep a host silent for seconds: no replacement in this test.
missed_heartbeats = 60
http_address = "127.0.0.1:{http}"
auth_token = "{TOKEN}"

[placement]
replicas_per_kernel = 2
"""
        + hosts
    )
    yield LocalCluster(path, f"127.0.0.1:{control}", f"http://127.0.0.1:{http}")
    for pid in running(tmp_path).pids:  # what a failed test left
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def cluster(*argv: str) -> str:
    return await anyio.to_thread.run_sync(nbos, ["cluster", *argv])


@pytest.mark.long  # a whole cluster up, restarted and down: most of a minute
async def test_up_again_restart_and_down_keep_one_cluster_and_its_kernel(
    local_cluster: LocalCluster,
) -> None:
    root, path, address = local_cluster.root, str(local_cluster.path), local_cluster.address
    await cluster("up", path)
    first = running(root)
    assert len(first.gateways) == 1 and sorted(first.agents) == list(HOSTS), first
    # The cluster file's [gateway] http_address and auth_token: a --gateway-url to serve.
    specs = f"{local_cluster.url}/api/kernelspecs"
    assert (await call(specs))[0] == 401
    assert (await call(specs, token=TOKEN))[0] == 200
    # Up on a cluster that runs starts nothing.
    await cluster("up", path)
    assert running(root) == first

    started = await ask(address, StartKernel())
    assert isinstance(started, KernelInfo), started
    replicas = sorted(r.pid for r in started.replicas if r.pid is not None)
    assert len(replicas) == 2
    assert await run_cell(started, "x = 41") == {"status": "ok", "stdout": ""}

    # The gateway killed: up starts a gateway, no agent; the kernel is taken back.
    os.kill(first.gateways[0], signal.SIGKILL)
    await cluster("up", path)
    second = running(root)
    assert second.agents == first.agents and second.gateways != first.gateways
    assert await _cell(address, started, "print(x)") == "41\n"

    # A restarted gateway (SIGTERM, then started) keeps the kernel.
    await cluster("restart", path, "gateway")
    third = running(root)
    assert third.agents == first.agents and third.gateways != second.gateways
    assert await _cell(address, started, "x += 1; print(x)") == "42\n"

    # A restarted agent: its replica runs on, and the new agent adopts it.
    await cluster("restart", path, "h1")
    fourth = running(root)
    assert fourth.gateways == third.gateways
    assert fourth.agents["h2"] == first.agents["h2"] and fourth.agents["h1"] != first.agents["h1"]
    assert replicas == sorted(fourth.replicas)
    assert await _cell(address, started, "print(x)") == "42\n"

    assert "stopped: gateway, h1, h2" in await cluster("down", path)
    assert running(root).pids == set()
    assert json.loads((root / "run" / RECORD).read_text()) == {"gateway": None, "agents": []}
    state = json.loads((root / "run" / "gateway" / "gateway" / "state.json").read_text())
    assert state["kernels"] == []


async def _cell(address: str, kernel: KernelInfo, code: str) -> str:
    """``code``'s output in ``kernel``, once the gateway serves it with its replicas alive."""
    await status_when(
        address,
        lambda s: any(
            k.kernel_id == kernel.kernel_id and all(r.alive for r in k.replicas) for k in s.kernels
        ),
    )
    result = await run_cell(kernel, code)
    assert result["status"] == "ok", result
    return str(result["stdout"])


def test_the_scan_finds_this_interpreter_by_its_environment(tmp_path: Path) -> None:
    """The /proc scan this module relies on sees a process named only in its environment."""
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "MARK": str(tmp_path)},
    )
    try:
        assert sleeper.pid in running(tmp_path).replicas
    finally:
        sleeper.kill()
        sleeper.wait()
    assert running(tmp_path).pids == set()
