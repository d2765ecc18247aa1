"""Lazy eviction on agents that are processes of their own (``nbos agent``), as on servers.

A kernel's tensors stay on its GPUs after its cell; when the host hands those GPUs to
another kernel's cell, its agent first has the first kernel's replica there move them to
host memory, over the replica's control channel.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant, Kernel
from nbos.gateway.service import GatewayService
from nbos.kernel.client import ExecuteResult
from tests.agent._daemons import DEADLINE
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def agent_logs(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*.log") if p.is_file())


async def resident_kernel(
    service: GatewayService, b_gpus: int, hogs_gpus: int
) -> tuple[Kernel, Kernel, HostId, list[Grant]]:
    """Kernels a (2 GPUs) and b (``b_gpus``), a's tensors on both GPUs of a's host, and
    ``hogs_gpus`` GPUs of each other host committed to hogs: a, b, a's host, the hogs."""
    scheduler = service.directory.scheduler
    a = await service.kernel_manager.start_kernel(gpus=2)
    b = await service.kernel_manager.start_kernel(gpus=b_gpus)
    ran = await a.execute("import torch\nw = torch.arange(4.0)", timeout=DEADLINE)
    assert ran.status == "ok", ran.reply
    host = next(r.host for r in a.replicas if r.node == ran.executor)
    hogs: list[Grant] = []
    others = sorted(h.host_id for h in scheduler.view().hosts if h.host_id != host)
    for i, other in enumerate(others):
        grant = await scheduler.acquire(
            KernelId(f"hog-{i}"), 1, {1: HostId(other)}, last_executor=None, gpus=hogs_gpus
        )
        hogs.append(await scheduler.committed(grant))
    return a, b, host, hogs


async def test_an_agent_has_the_resident_kernel_move_its_tensors_off_before_another_kernel_runs(
    tmp_path: Path,
) -> None:
    async with GatewayService.serve(
        local_settings(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        # Only a's host has 2 GPUs free for b, and they hold a's tensors.
        a, b, host, hogs = await resident_kernel(service, b_gpus=2, hogs_gpus=1)
        result = await b.execute("print('ran')", timeout=DEADLINE)
        assert result.stdout == "ran\n", result.reply
        assert next(r.host for r in b.replicas if r.node == result.executor) == host
        evicted = f"host {host}: kernel {a.kernel_id} evicted from devices [0, 1]"
        assert evicted in agent_logs(tmp_path)
        # a's next cell brings its tensors back.
        for grant in hogs:
            await service.directory.scheduler.release(grant)
        assert (await a.execute("print(w.sum().item())")).stdout == "6.0\n"


# Holds its replica's main thread until ``flag`` exists, as any cell's code may.
HOLD = """%%gpus 1
import os, time
open({started!r}, "w").close()
while not os.path.exists({flag!r}):
    time.sleep(0.05)
print(w.sum().item())
"""


async def test_a_replica_running_a_cell_answers_at_once_for_a_device_its_tensors_left(
    tmp_path: Path,
) -> None:
    # a ran on both GPUs of its host, then a cell on one of them, which moved its tensors
    # there. Its host still counts the other as a's (lazily resident) and has a's replica
    # evict before b's cell gets it. The replica answered only from its main thread, held
    # by the running cell: b waited for a's cell to end, or for the agent's 30 s timeout
    # and a refusal (a replayed trace's cell waited 2 s so).
    started, flag = tmp_path / "started", tmp_path / "flag"
    async with GatewayService.serve(
        local_settings(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        # Only a's host has a GPU free for b, and it holds a's tensors.
        a, b, host, _ = await resident_kernel(service, b_gpus=1, hogs_gpus=2)
        held: list[ExecuteResult] = []

        async def hold() -> None:
            code = HOLD.format(started=str(started), flag=str(flag))
            held.append(await a.execute(code, timeout=DEADLINE))

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            with anyio.fail_after(DEADLINE):
                while not started.exists():  # noqa: ASYNC110 - a file, no event to wait on
                    await anyio.sleep(0.05)
            result = await b.execute("print('ran')", timeout=DEADLINE)
            assert result.stdout == "ran\n", result.reply
            assert next(r.host for r in b.replicas if r.node == result.executor) == host
            assert not held  # a's cell still runs
            assert f"host {host}: kernel {a.kernel_id} evicted from devices" in agent_logs(tmp_path)
            flag.touch()
        assert held[0].stdout == "6.0\n", held[0].reply
