"""``[agent] runtime = "docker"``: a gateway and 3 ``nbos agent`` processes whose replicas are
containers on the session's Docker engine; cells run, a ``kill -9`` inside a container is a
replica death the gateway hears of and repairs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from nbos.agent import AgentConfig
from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.gateway.control_api import ClusterStatus, KernelInfo, StartKernel
from nbos.transport.ports import free_loopback_ports
from tests._servers.dockerd import DockerDaemon, docker_mounts
from tests.agent._daemons import DEADLINE, AgentProcess, alive, start_agent
from tests.gateway._service import ask, run_cell, start_gateway, status_when

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

HOSTS = ("dk-1", "dk-2", "dk-3")


@attrs.frozen
class DockerCluster:
    daemon: DockerDaemon
    address: str
    agents: list[AgentProcess]
    #: How the agents were started (the gateway's agent endpoint, their directory, settings).
    gateway: str
    tmp: Path
    config: Path

    def restart_agent(self, host: str) -> AgentProcess:
        """``kill -9`` host's agent and start it again on the same state directory (as
        Swarm restarts a killed agent container on its node)."""
        index = [a.host for a in self.agents].index(host)
        self.agents[index].kill()
        self.agents[index].wait()
        self.agents[index] = start_agent(host, self.gateway, self.tmp, config=self.config)
        return self.agents[index]

    def containers(self) -> dict[int, dict[str, Any]]:
        """This cluster's running replica containers, by their first process's host PID."""
        filters = urllib.parse.quote(json.dumps({"label": ["nbos.host"]}))
        status, body = self.daemon.request("GET", f"/containers/json?filters={filters}")
        assert status == 200, body
        found: dict[int, dict[str, Any]] = {}
        for listed in json.loads(body):
            if listed["Labels"]["nbos.host"] not in HOSTS:
                continue
            _, shown = self.daemon.request("GET", f"/containers/{listed['Id']}/json")
            state = json.loads(shown)
            found[state["State"]["Pid"]] = state
        return found

    def remove_all(self) -> None:
        for host in HOSTS:
            filters = urllib.parse.quote(json.dumps({"label": [f"nbos.host={host}"]}))
            _, body = self.daemon.request("GET", f"/containers/json?all=1&filters={filters}")
            for listed in json.loads(body):
                self.daemon.request("DELETE", f"/containers/{listed['Id']}?force=1")


@pytest.fixture(scope="module")
def cluster(
    docker_daemon: DockerDaemon, docker_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DockerCluster]:
    tmp = tmp_path_factory.mktemp("docker-runtime")
    control, agents = free_loopback_ports(2)
    env = {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__LOCAL_AGENTS": "false",
        "NBOS_GATEWAY__HEARTBEAT_S": "0.2",
        "NBOS_GATEWAY__MISSED_HEARTBEATS": "25",
        "NBOS_CLUSTER__DATA_DIR": str(tmp / "run"),
    }
    gateway = start_gateway(env, tmp / "gateway.log")
    config = tmp / "agent.toml"
    # The image is empty: the host's system, this interpreter and checkout come in read-only;
    # tmp (the gateway's directory store) read-write. STATE/work the agent mounts itself.
    config.write_text(
        f"""[agent]
runtime = "docker"
docker_engine = "{docker_daemon.url}"
docker_image = "{docker_image}"
docker_mounts = {json.dumps(docker_mounts(tmp))}
"""
    )
    started = [start_agent(h, f"127.0.0.1:{agents}", tmp, config=config) for h in HOSTS]
    made = DockerCluster(
        docker_daemon, f"127.0.0.1:{control}", started, f"127.0.0.1:{agents}", tmp, config
    )
    try:
        yield made
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
        for agent in started:
            agent.kill()
            agent.wait()
        made.remove_all()


def replicas_of(status: ClusterStatus, kernel_id: str) -> dict[int, tuple[int | None, bool]]:
    """The kernel's replicas now: node -> (pid, alive)."""
    (kernel,) = [k for k in status.kernels if k.kernel_id == kernel_id]
    return {r.node: (r.pid, r.alive) for r in kernel.replicas}


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_replicas_run_as_containers_and_a_killed_one_is_seen_dead_and_replaced(
    cluster: DockerCluster,
) -> None:
    await status_when(cluster.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    kernel = await ask(cluster.address, StartKernel())
    assert isinstance(kernel, KernelInfo), kernel
    assert await run_cell(kernel, "x = 40; import os; print(os.environ['NBOS_HOST_ID'])") in [
        {"status": "ok", "stdout": f"{h}\n"} for h in HOSTS
    ]

    # Every replica is a container on the engine, its PID the container's first process.
    containers = cluster.containers()
    pids = {r.pid for r in kernel.replicas}
    assert pids <= set(containers), (pids, list(containers))
    for replica in kernel.replicas:
        shown = containers[replica.pid or 0]
        assert shown["HostConfig"]["NetworkMode"] == "host"
        assert shown["Config"]["Labels"]["nbos.host"] == replica.host

    # kill -9 of the replica process inside one container (under Docker's init).
    victim = kernel.replicas[1]
    assert victim.pid is not None
    (process,) = children(victim.pid)
    os.kill(process, signal.SIGKILL)
    # Seen dead (a signal 9 exit, reported by its agent), then replaced by a new node.
    replaced = await status_when(
        cluster.address,
        lambda s: (
            victim.node not in (now := replicas_of(s, kernel.kernel_id))
            and len(now) == 3
            and all(alive for _, alive in now.values())
        ),
    )
    agent = next(a for a in cluster.agents if a.host == victim.host)
    assert f"(pid {victim.pid}) ended: exit code None, signal 9" in agent.log_text()
    with anyio.fail_after(DEADLINE):
        while alive(victim.pid):  # noqa: ASYNC110 (another process's end: polled)
            await anyio.sleep(0.2)
    (new,) = set(replicas_of(replaced, kernel.kernel_id)) - {r.node for r in kernel.replicas}
    assert replicas_of(replaced, kernel.kernel_id)[new][0] in cluster.containers()
    assert await run_cell(kernel, "print(x + 2)") == {"status": "ok", "stdout": "42\n"}


async def test_replica_containers_are_labelled_and_outlive_their_agent(
    cluster: DockerCluster,
) -> None:
    await status_when(cluster.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    kernel = await ask(cluster.address, StartKernel())
    assert isinstance(kernel, KernelInfo), kernel
    assert (await run_cell(kernel, "y = 'kept'"))["status"] == "ok"
    filters = urllib.parse.quote(json.dumps({"label": [f"nbos.kernel={kernel.kernel_id}"]}))
    status, body = cluster.daemon.request("GET", f"/containers/json?filters={filters}")
    assert status == 200, body
    labelled = {c["Labels"]["nbos.host"]: c for c in json.loads(body)}
    assert sorted(labelled) == sorted(r.host for r in kernel.replicas)
    assert all(c["Labels"]["nbos.replica"] for c in labelled.values())

    # The agent of one replica's host is killed and started again: it takes the container
    # back, and the kernel keeps its replicas (none replaced) and its namespace.
    before = replicas_of(await ask_status(cluster), kernel.kernel_id)
    host = kernel.replicas[0].host
    agent = cluster.restart_agent(host)
    with anyio.fail_after(DEADLINE):
        while "taken back" not in agent.log_text():  # noqa: ASYNC110 (another process's log)
            await anyio.sleep(0.2)
    after = await status_when(
        cluster.address,
        lambda s: (
            sum(h.state == "up" for h in s.hosts) == 3
            and all(alive for _, alive in replicas_of(s, kernel.kernel_id).values())
        ),
    )
    assert replicas_of(after, kernel.kernel_id) == before
    assert labelled[host]["Id"] in {c["Id"] for c in running(cluster)}
    assert await run_cell(kernel, "print(y)") == {"status": "ok", "stdout": "kept\n"}


async def ask_status(cluster: DockerCluster) -> ClusterStatus:
    return await status_when(cluster.address, lambda _: True)


def running(cluster: DockerCluster) -> list[dict[str, Any]]:
    status, body = cluster.daemon.request("GET", "/containers/json")
    assert status == 200, body
    listed: list[dict[str, Any]] = json.loads(body)
    return listed


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"NBOS_AGENT__RUNTIME": "podman"}, "agent.runtime"),
        ({"NBOS_AGENT__RUNTIME": "docker"}, "agent.docker_image"),
        ({"NBOS_AGENT__DOCKER_IMAGE": "nbos:1"}, "agent.docker_image"),
        (
            {
                "NBOS_AGENT__RUNTIME": "docker",
                "NBOS_AGENT__DOCKER_IMAGE": "i",
                **{"NBOS_AGENT__DOCKER_ENGINE": "/var/run/docker.sock"},
            },
            "agent.docker_engine",
        ),
    ],
)
def test_agent_settings_that_cannot_take_effect_are_refused_with_their_key(
    env: dict[str, str], key: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as refused:
        settings = Settings.load(env=env)
        AgentConfig("h1", "127.0.0.1:0", "127.0.0.1:1", tmp_path, settings=settings.agent)
    assert refused.value.key == key
