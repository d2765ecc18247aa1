"""``nbos cluster up|down`` for real: an agent over SSH into a network namespace, an agent
in a container on a private Docker engine; a kernel runs a cell on each; down leaves nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from nbos.deploy._up import RECORD
from tests._servers._process import process_running, serve_or_skip
from tests._servers.dockerd import DockerDaemon
from tests._servers.netns import Netns, netns_or_skip
from tests._servers.sshd import SshServer, start_sshd
from tests.agent._daemons import DEADLINE, ROOT

# Each test starts a gateway and an agent and runs a kernel: slow on a loaded machine.
pytestmark = pytest.mark.timeout(600)

NBOS = [sys.executable, "-m", "nbos"]
CELL = "import os; print(os.environ['NBOS_HOST_ID'])"


def nbos(argv: Sequence[str], where: Sequence[str] = ()) -> str:
    """``nbos ARGV`` (inside ``where``, a namespace's prefix); its stdout, or the test fails."""
    done = subprocess.run(
        [*where, *NBOS, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=4 * DEADLINE,
        check=False,
    )
    assert done.returncode == 0, f"nbos {argv} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def kernel_cell(address: str, where: Sequence[str] = ()) -> list[dict[str, object]]:
    """A 1-replica kernel started on the gateway at ``address``; it runs ``CELL``."""
    commands = '{"op": "start", "gpus": 0}\n' + json.dumps({"op": "cell", "code": CELL}) + "\n"
    done = subprocess.run(
        [*where, sys.executable, "-m", "tests.gateway._netns_client", address],
        input=commands,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=4 * DEADLINE,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def recorded_pids(run_dir: Path) -> list[int]:
    record = json.loads((run_dir / RECORD).read_text())
    return [p["pid"] for p in [record["gateway"], *record["agents"]] if p and p["pid"]]


def common(address: str) -> str:
    return f"""
[gateway]
address = "{address}:17170"
agent_address = "{address}:17171"
heartbeat_s = 0.5

[placement]
replicas_per_kernel = 1
"""


# --- SSH -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def net() -> Iterator[Netns]:
    yield from netns_or_skip(["gw", "s1"])


@pytest.fixture(scope="module")
def sshd(net: Netns, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    workdir = tmp_path_factory.mktemp("sshd")
    yield from serve_or_skip(
        lambda: start_sshd(
            workdir, address=net.address("s1"), where=lambda argv: net.argv("s1", argv)
        ),
        "a real sshd",
    )


@pytest.mark.long
def test_ssh_host_up_cell_down(net: Netns, sshd: SshServer, tmp_path: Path) -> None:
    s1 = net.address("s1")
    path = tmp_path / "cluster.toml"
    path.write_text(
        common(net.address("gw"))
        + f"""
[store]
shared = true
path = "{tmp_path / "store"}"

[[hosts]]
name = "s1"
address = "{s1}"
agent_port = 7100
gpus = 1
start = "ssh"
command = {json.dumps(NBOS)}
env = {{ PYTHONPATH = "{ROOT}" }}
dir = "{tmp_path / "remote"}"
[hosts.ssh]
port = {sshd.port}
user = "{sshd.user}"
key_file = "{sshd.client_key}"
known_hosts = "{sshd.known_hosts}"
"""
    )
    gw = net.argv("gw", [])
    shown = nbos(["cluster", "up", str(path)], gw)
    assert "s1" in shown and "up" in shown, shown
    # The host's own pair and the gateway's public key only, private, written over SSH.
    keys = tmp_path / "remote" / "keys"
    assert sorted(str(p.relative_to(keys)) for p in keys.rglob("*.key*")) == [
        "gateway.key",
        "hosts/s1.key_secret",
    ]
    assert (keys / "hosts" / "s1.key_secret").stat().st_mode & 0o077 == 0
    started, cell = kernel_cell(f"{net.address('gw')}:17170", gw)
    assert [r["ip"] for r in started["replicas"]] == [s1]  # type: ignore[index]
    assert cell == {"status": "ok", "stdout": "s1\n"}
    pids = recorded_pids(tmp_path / "run")
    replicas = [r["pid"] for r in started["replicas"]]  # type: ignore[index]
    assert "stopped: gateway, s1" in nbos(["cluster", "down", str(path)], gw)
    assert not [p for p in [*pids, *replicas] if process_running(p)]
    assert json.loads((tmp_path / "run" / RECORD).read_text()) == {
        "gateway": None,
        "agents": [],
    }


# --- Docker ----------------------------------------------------------------------


def containers(daemon: DockerDaemon) -> list[dict[str, object]]:
    filters = urllib.parse.quote(json.dumps({"label": ["nbos.host=d1"]}))
    status, body = daemon.request("GET", f"/containers/json?all=1&filters={filters}")
    assert status == 200
    listed: list[dict[str, object]] = json.loads(body)
    return listed


def test_docker_host_up_cell_down(
    docker_daemon: DockerDaemon, docker_image: str, tmp_path: Path
) -> None:
    image = docker_image
    (tmp_path / "tmp").mkdir()
    system = [p for p in ("/usr", "/lib", "/lib64", "/bin", "/etc") if Path(p).exists()]
    # The interpreter, its virtual environment and this checkout, at their own paths.
    read_only = [*system, sys.base_prefix, sys.prefix, str(ROOT)]
    mounts = [f"{p}:{p}:ro" for p in dict.fromkeys(read_only)] + [f"{tmp_path / 'tmp'}:/tmp"]
    path = tmp_path / "cluster.toml"
    path.write_text(
        common("127.0.0.1")
        + f"""
[[hosts]]
name = "d1"
address = "127.0.0.1"
gpus = 1
start = "docker"
command = {json.dumps(NBOS)}
env = {{ PYTHONPATH = "{ROOT}", HOME = "/tmp" }}
[hosts.docker]
engine = "{docker_daemon.url}"
image = "{image}"
mounts = {json.dumps(mounts)}
"""
    )
    shown = nbos(["cluster", "up", str(path)])
    assert "d1" in shown and "up" in shown, shown
    (running,) = containers(docker_daemon)
    assert running["State"] == "running"
    _, cell = kernel_cell("127.0.0.1:17170")
    assert cell == {"status": "ok", "stdout": "d1\n"}
    pids = recorded_pids(tmp_path / "run")
    assert "stopped: gateway, d1" in nbos(["cluster", "down", str(path)])
    # The replicas ran in the container (their pids are its own): gone with it.
    assert containers(docker_daemon) == []
    assert not [p for p in pids if process_running(p)]
