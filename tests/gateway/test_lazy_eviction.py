"""Lazy eviction on agents that are processes of their own (``nbos agent``), as on servers.

A kernel's tensors stay on its GPUs after its cell; when the host hands those GPUs to
another kernel's cell, its agent first has the first kernel's replica there move them to
host memory, over the replica's control channel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant
from nbos.gateway.service import GatewayService
from tests.agent._daemons import DEADLINE
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def agent_logs(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*.log") if p.is_file())


async def test_an_agent_has_the_resident_kernel_move_its_tensors_off_before_another_kernel_runs(
    tmp_path: Path,
) -> None:
    async with GatewayService.serve(
        local_settings(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        scheduler = service.directory.scheduler
        a = await service.kernel_manager.start_kernel(gpus=2)
        b = await service.kernel_manager.start_kernel(gpus=2)
        ran = await a.execute("import torch\nw = torch.arange(4.0)", timeout=DEADLINE)
        assert ran.status == "ok", ran.reply
        host = next(r.host for r in a.replicas if r.node == ran.executor)
        # Only a's host has 2 GPUs free for b, and they hold a's tensors.
        hogs: list[Grant] = []
        others = sorted(h.host_id for h in scheduler.view().hosts if h.host_id != host)
        for i, other in enumerate(others):
            grant = await scheduler.acquire(
                KernelId(f"hog-{i}"), 1, {1: HostId(other)}, last_executor=None, gpus=1
            )
            hogs.append(await scheduler.committed(grant))

        result = await b.execute("print('ran')", timeout=DEADLINE)
        assert result.stdout == "ran\n", result.reply
        assert next(r.host for r in b.replicas if r.node == result.executor) == host
        evicted = f"host {host}: kernel {a.kernel_id} evicted from devices [0, 1]"
        assert evicted in agent_logs(tmp_path)
        # a's next cell brings its tensors back.
        for grant in hogs:
            await scheduler.release(grant)
        assert (await a.execute("print(w.sum().item())")).stdout == "6.0\n"
