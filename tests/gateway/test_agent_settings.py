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
        pids = {r.pid for r in kernel.replicas}
    # The wrapper execs the interpreter: each replica keeps the pid it wrote (so do the
    # agents' pre-started replicas, which also run it).
    assert pids <= {int(line) for line in started.read_text().split()}
