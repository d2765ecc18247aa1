"""Where a cell's delay went, on a real gateway: a cell that waits for the GPUs another
kernel's cell holds has its wait counted as a wait for GPUs, in the gateway's ledger and
in its Prometheus metrics (``nbos_cell_delay_seconds_total{cause}``)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import anyio
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nbos.gateway.service import GatewayService
from nbos.transport.ports import free_loopback_ports
from tests._wait import eventually
from tests.agent._daemons import DEADLINE
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def delay_seconds(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["cause"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "nbos_cell_delay_seconds"
        for sample in family.samples
        if sample.name == "nbos_cell_delay_seconds_total"
    }


async def test_a_cell_waiting_for_the_gpus_another_kernel_holds_is_split_as_a_gpu_wait(
    tmp_path: Path,
) -> None:
    (metrics,) = free_loopback_ports(1)
    settings = local_settings(tmp_path, metrics_address=f"127.0.0.1:{metrics}")
    # One host of 2 GPUs, kernels of one replica (subscribing none, their cells ask for
    # both GPUs): nowhere to go but wait.
    cluster = msgspec.structs.replace(settings.cluster, hosts=1, replicas_per_kernel=1)
    settings = msgspec.structs.replace(settings, cluster=cluster)
    go = tmp_path / "go"
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        scheduler = service.directory.scheduler
        holder = await service.kernel_manager.start_kernel(gpus=0)
        waiter = await service.kernel_manager.start_kernel(gpus=0)
        hold = f"%%gpus 2\nimport os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder.execute, hold)
            await eventually(lambda: bool(scheduler.grants()), timeout=DEADLINE)
            tg.start_soon(waiter.execute, "%%gpus 2\nprint('ran')")
            await eventually(
                lambda: any(k == waiter.kernel_id for k, _ in scheduler.waiting()),
                timeout=DEADLINE,
            )
            go.touch()
        cell = scheduler.ledger.cell(waiter.kernel_id, 1)
        assert cell is not None and cell.arrived is not None
        split = cell.split()
        assert split is not None
        assert split.gpus > 0, split
        assert (split.scale_out, split.migration) == (0.0, 0.0), split
        assert split.gpus == max(split.values()), split
        # The metrics are served by this process: scraped from another thread.
        counted = await anyio.to_thread.run_sync(delay_seconds, service.addresses["metrics"])
        assert set(counted) == {"queue", "gpus", "migration", "scale_out", "overhead"}
        assert counted["gpus"] >= split.gpus and counted["migration"] == 0.0, counted
