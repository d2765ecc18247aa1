"""The ``docker`` host provider: an autoscaled gateway gets a host whose agent is a container.

The container runs this interpreter and nbos from bind mounts of the host's directories
(``docker_mounts``), on the host network of a private ``dockerd``; the test skips where no
Docker engine can run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nbos.core.config import ClusterSettings, GatewaySettings, Settings
from nbos.core.ids import HostId
from nbos.gateway.service import GatewayService
from nbos.transport.ports import free_loopback_ports
from tests._servers.dockerd import DockerDaemon, docker_mounts

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_the_docker_provider_adds_an_agent_container_that_runs_a_kernel(
    docker_daemon: DockerDaemon, docker_image: str, tmp_path: Path
) -> None:
    control, agents = free_loopback_ports(2)
    mounts = docker_mounts(tmp_path)
    settings = Settings(
        cluster=ClusterSettings(
            gpus_per_host=2, replicas_per_kernel=1, data_dir=str(tmp_path / "run")
        ),
        gateway=GatewaySettings(
            address=f"127.0.0.1:{control}",
            agent_address=f"127.0.0.1:{agents}",
            heartbeat_s=0.2,
            missed_heartbeats=50,
            local_agents=False,
            autoscale=True,
            min_hosts=1,
            max_hosts=1,
            autoscale_period_s=0.3,
            host_provider="docker",
            host_provider_options={
                "engines": {"e1": docker_daemon.url},
                "image": docker_image,
                "python": sys.executable,
                "state_dir": str(tmp_path / "agents"),
                "mounts": mounts,
                "virtual_gpus": True,
            },
        ),
    )
    async with GatewayService.serve(settings) as service:
        await service.directory.scheduler.wait_for_host(HostId("docker-1"), 240)
        kernel = await service.gateway.start_kernel(gpus=1)
        assert [r.host for r in kernel.replicas] == ["docker-1"]
        result = await kernel.execute("%%gpus 1\nprint(6 * 7)")
        assert result.stdout == "42\n", result.reply
