"""The gateway's ``[agent]`` table reaches the agents it starts on this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from nbos.core.config import AgentSettings
from nbos.gateway.service import GatewayService
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_local_agents_run_replicas_with_the_gateways_agent_settings(
    tmp_path: Path,
) -> None:
    # Its [agent] table once reached local agents only through NBOS_AGENT__* variables:
    # the same keys in a settings file were accepted and did nothing.
    started = tmp_path / "started"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$$" >> {started}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    settings = msgspec.structs.replace(
        local_settings(tmp_path), agent=AgentSettings(python=str(python))
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        kernel = await service.kernel_manager.start_kernel()
        assert (await kernel.execute("x = 1")).status == "ok"
        pids = {r.pid: parent_of(r.pid) for r in kernel.replicas if r.pid is not None}
    # The wrapper execs the interpreter: each replica keeps the pid it wrote (so do the
    # agents' pre-started replicas, which also run it), or was forked from the agent's
    # template replica, which did: whether a replica is forked depends on the template
    # being up yet.
    wrapped = {int(line) for line in started.read_text().split()}
    assert len(pids) == 3
    assert all(pid in wrapped or parent in wrapped for pid, parent in pids.items()), pids


def parent_of(pid: int) -> int:
    """The parent process id of running process ``pid``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
