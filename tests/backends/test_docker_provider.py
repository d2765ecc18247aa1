"""The ``docker`` host provider: an autoscaled gateway gets a host whose agent is a container.

The container runs this interpreter and nbos from bind mounts of the host's directories
(``docker_mounts``), on the host network of a private ``dockerd``; the test skips where no
Docker engine can run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nbos.core.ids import HostId
from nbos.gateway.service import GatewayService
from tests._servers.dockerd import DockerDaemon, docker_mounts
from tests.backends._provider import one_provided_host

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_the_docker_provider_adds_an_agent_container_that_runs_a_kernel(
    docker_daemon: DockerDaemon, docker_image: str, tmp_path: Path
) -> None:
    mounts = docker_mounts(tmp_path)
    settings = one_provided_host(
        tmp_path,
        "docker",
        {
            "engines": {"e1": docker_daemon.url},
            "image": docker_image,
            "python": sys.executable,
            "state_dir": str(tmp_path / "agents"),
            "mounts": mounts,
            "virtual_gpus": True,
        },
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        await service.directory.scheduler.wait_for_host(HostId("docker-1"), 240)
        kernel = await service.kernel_manager.start_kernel(gpus=1)
        assert [r.host for r in kernel.replicas] == ["docker-1"]
        result = await kernel.execute("%%gpus 1\nprint(6 * 7)")
        assert result.stdout == "42\n", result.reply
