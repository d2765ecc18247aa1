"""The ``ssh`` host provider: an autoscaled gateway gets a host of its standby pool, whose
agent it starts over SSH (a real ``sshd`` on loopback; the test skips where none can run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nbos.core.ids import HostId
from nbos.gateway.service import GatewayService
from tests._servers.sshd import SshServer
from tests.backends._provider import one_provided_host

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_the_ssh_provider_starts_a_standby_hosts_agent_that_runs_a_kernel(
    sshd_server: SshServer, tmp_path: Path
) -> None:
    target = {
        "address": "127.0.0.1",
        "port": sshd_server.port,
        "user": sshd_server.user,
        "key_file": str(sshd_server.client_key),
        "known_hosts": str(sshd_server.known_hosts),
    }
    settings = one_provided_host(
        tmp_path,
        "ssh",
        {
            "hosts": {"standby-1": target},
            "python": sys.executable,
            "state_dir": str(tmp_path / "agents"),
            "virtual_gpus": True,
        },
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        await service.directory.scheduler.wait_for_host(HostId("standby-1"), 240)
        kernel = await service.kernel_manager.start_kernel(gpus=1)
        assert [r.host for r in kernel.replicas] == ["standby-1"]
        result = await kernel.execute("%%gpus 1\nimport os\nprint(os.environ['NBOS_HOST_ID'])")
        assert result.stdout == "standby-1\n", result.reply
