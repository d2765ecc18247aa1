"""The ``ssh`` host provider: an autoscaled gateway gets a host of its standby pool, whose
agent it starts over SSH (a real ``sshd`` on loopback; the test skips where none can run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nbos.core.config import ClusterSettings, GatewaySettings, Settings
from nbos.core.ids import HostId
from nbos.gateway.service import GatewayService
from nbos.transport.ports import free_loopback_ports
from tests._servers.sshd import SshServer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_the_ssh_provider_starts_a_standby_hosts_agent_that_runs_a_kernel(
    sshd_server: SshServer, tmp_path: Path
) -> None:
    control, agents = free_loopback_ports(2)
    target = {
        "address": "127.0.0.1",
        "port": sshd_server.port,
        "user": sshd_server.user,
        "key_file": str(sshd_server.client_key),
        "known_hosts": str(sshd_server.known_hosts),
    }
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
            host_provider="ssh",
            host_provider_options={
                "hosts": {"standby-1": target},
                "python": sys.executable,
                "state_dir": str(tmp_path / "agents"),
                "virtual_gpus": True,
            },
        ),
    )
    async with GatewayService.serve(settings) as service:
        await service.directory.scheduler.wait_for_host(HostId("standby-1"), 240)
        kernel = await service.gateway.start_kernel(gpus=1)
        assert [r.host for r in kernel.replicas] == ["standby-1"]
        result = await kernel.execute("%%gpus 1\nimport os\nprint(os.environ['NBOS_HOST_ID'])")
        assert result.stdout == "standby-1\n", result.reply
