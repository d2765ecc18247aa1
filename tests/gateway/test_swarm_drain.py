"""An agent told to stop (SIGTERM, as Swarm stops its task): replicas move off only when its
swarm node is drained.

A real gateway with ``[gateway] swarm_engine`` at a one-node swarm's manager, and four
``nbos agent`` processes, one named as that node's hostname. While the node is
``active``, SIGTERM (a rolling upgrade's) stops that agent at once and its replicas keep
running for the next agent to take back; once the node is ``drain``, SIGTERM makes the
agent wait while the gateway moves its replicas to other hosts, and then go. The
kernels keep their namespaces throughout.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.gateway._kernel import Kernel
from nbos.gateway.service import GatewayService
from tests._servers.dockerd import DockerDaemon
from tests.agent._daemons import DEADLINE, AgentProcess, alive, start_agent
from tests.gateway._service import local_settings
from tests.gateway._swarm import node, set_node, swarm_manager

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    yield from swarm_manager(tmp_path_factory.mktemp("swarm"))


async def _exit(agent: AgentProcess) -> int:
    with anyio.fail_after(4 * DEADLINE):
        while agent.process.poll() is None:  # noqa: ASYNC110 (another process's end: polled)
            await anyio.sleep(0.2)
    return agent.process.returncode


def _pids_on(kernels: list[Kernel], host: str) -> list[int]:
    return [r.pid for k in kernels for r in k.replicas if r.host == host and r.pid is not None]


async def test_a_drained_nodes_agent_waits_until_its_replicas_moved_off(
    manager: DockerDaemon, tmp_path: Path
) -> None:
    hostname = node(manager)["Description"]["Hostname"]
    assert hostname == socket.gethostname()
    hosts = [hostname, "d-2", "d-3", "d-4"]
    settings = local_settings(tmp_path, local_agents=False, swarm_engine=manager.url)
    # An agent restarted on a loaded machine may take its while: not a failure here.
    gateway_settings = msgspec.structs.replace(settings.gateway, missed_heartbeats=300)
    settings = msgspec.structs.replace(settings, gateway=gateway_settings)
    gateway = settings.gateway.agent_address
    agents: list[AgentProcess] = []
    try:
        async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
            agents = [start_agent(h, gateway, tmp_path) for h in hosts]
            await service.directory.wait_for_hosts(4, timeout=3 * DEADLINE)
            # Two kernels: least-loaded placement puts a replica on every one of 4 hosts.
            kernels = [await service.kernel_manager.start_kernel() for _ in range(2)]
            for n, kernel in enumerate(kernels):
                assert (await kernel.execute(f"x = {n}")).status == "ok"
            pids = _pids_on(kernels, hostname)
            assert pids

            # Active node: SIGTERM (an upgrade's) stops the agent at once; nothing moves.
            agents[0].kill(signal.SIGTERM)
            assert await _exit(agents[0]) == 0
            assert "replicas stay" in agents[0].log_text()
            assert all(alive(p) for p in pids)
            agents[0] = start_agent(hostname, gateway, tmp_path)
            with anyio.fail_after(DEADLINE):
                while "taken back" not in agents[0].log_text():  # noqa: ASYNC110
                    await anyio.sleep(0.2)
            await service.directory.wait_for_hosts(4, timeout=3 * DEADLINE)
            assert _pids_on(kernels, hostname) == pids

            # Drained node: the agent waits while the gateway moves its replicas off.
            set_node(manager, Availability="drain")
            agents[0].kill(signal.SIGTERM)
            assert await _exit(agents[0]) == 0
            log = agents[0].log_text()
            assert "node draining: moving replicas off (waits)" in log
            assert "host emptied (goes)" in log
            assert _pids_on(kernels, hostname) == []
            for n, kernel in enumerate(kernels):
                assert len(kernel.replicas) == 3
                assert all(r.alive for r in kernel.replicas)
                result = await kernel.execute(f"print(x + {10 * (n + 1)})")
                assert (result.status, result.stdout) == ("ok", f"{n + 10 * (n + 1)}\n")
            assert hostname not in {h.host_id for h in service.directory.hosts()}
    finally:
        set_node(manager, Availability="active")
        for agent in agents:
            agent.kill()
            agent.wait()
