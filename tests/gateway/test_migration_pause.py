"""A waiting cell's move whose target agent is paused (``kill -STOP``), on real agents.

The kernel's three replica hosts have their GPUs held, so its cell's one way to a GPU is a
move to the fourth host. That host's agent is paused as the cell asks: the move fails (the
agent does not answer), and the old replica serves on. Once the agent is resumed, the cell
moves there and runs, with the kernel's state intact. It used to wait for its other
replicas' GPUs for ever after the first failure.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from nbos.core.ids import HostId, KernelId
from nbos.gateway import GpuScheduler, Grant
from nbos.gateway.service import GatewayService
from tests._wait import eventually
from tests.agent._daemons import DEADLINE, AgentProcess, start_agent
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

HOSTS = ("h1", "h2", "h3", "h4")


async def hold_gpu(scheduler: GpuScheduler, host: str) -> Grant:
    """``host``'s one GPU, committed by a kernel of its own."""
    grant = await scheduler.acquire(
        KernelId(f"hog-{host}"), 1, {1: HostId(host)}, last_executor=None, gpus=1
    )
    return await scheduler.committed(grant)


async def test_a_cell_whose_moves_target_agent_was_paused_moves_there_once_it_is_back(
    tmp_path: Path, agents: list[AgentProcess], caplog: pytest.LogCaptureFixture
) -> None:
    settings = local_settings(tmp_path, local_agents=False)
    for host in HOSTS:
        agents.append(start_agent(host, settings.gateway.agent_address, tmp_path, gpus=1))
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        directory, scheduler = service.directory, service.directory.scheduler
        await directory.wait_for_hosts(len(HOSTS), timeout=DEADLINE)
        kernel = await service.kernel_manager.start_kernel(gpus=1)
        assert (await kernel.execute("x = 41")).status == "ok"
        on = {r.host for r in kernel.replicas}
        target = next(a for a in agents if a.host not in on)
        for host in sorted(on):
            await hold_gpu(scheduler, host)

        target.kill(signal.SIGSTOP)
        async with anyio.create_task_group() as tg:

            async def resume_once_the_move_failed() -> None:
                await eventually(lambda: "failed" in _migration_lines(caplog), DEADLINE)
                target.kill(signal.SIGCONT)

            tg.start_soon(resume_once_the_move_failed)
            result = await kernel.execute("print(x + 1)", timeout=3 * DEADLINE)
        assert result.stdout == "42\n", result.reply
        assert target.host in {r.host for r in kernel.replicas}
        digests = await kernel.digests()
        assert len(digests) == 3 and len(set(digests.values())) == 1, digests


def _migration_lines(caplog: pytest.LogCaptureFixture) -> str:
    lines = (r.getMessage() for r in caplog.records)
    return "\n".join(line for line in lines if "migrating replica" in line)
