"""An autoscaled gateway whose only host comes from a host provider (a test's own engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbos.core.config import ClusterSettings, GatewaySettings, Settings
from nbos.transport.ports import free_loopback_ports


def one_provided_host(tmp_path: Path, provider: str, options: dict[str, Any]) -> Settings:
    """A gateway with no local agents, scaled to exactly one host of ``provider``."""
    control, agents = free_loopback_ports(2)
    return Settings(
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
            host_provider=provider,
            host_provider_options=options,
        ),
    )
