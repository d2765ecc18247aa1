"""A kernelspec installed for a cluster file: its kernels run on that cluster's gateway."""

from __future__ import annotations

from pathlib import Path

import pytest
from jupyter_client.manager import AsyncKernelManager

from nbos.gateway.control_api import KernelList, ListKernels, call
from nbos.gateway.service import GatewayService
from nbos.jupyter import install
from tests.agent._daemons import DEADLINE
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the gateway's transport runs on asyncio


async def test_a_kernelspec_for_a_cluster_file_starts_its_kernels_on_that_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = local_settings(tmp_path)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'[gateway]\naddress = "{settings.gateway.address}"\n'
        f'agent_address = "{settings.gateway.agent_address}"\n\n'
        '[[hosts]]\nname = "a"\naddress = "127.0.0.1"\n'
    )
    prefix = tmp_path / "prefix"
    install(prefix=str(prefix), cluster=str(cluster))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    # Nothing else may name a gateway: the kernel must find it through the file alone.
    monkeypatch.delenv("NBOS_GATEWAY__ADDRESS", raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        km = AsyncKernelManager(kernel_name="nbos")
        await km.start_kernel()
        client = km.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=DEADLINE)
            listed = await call(service.control_address, ListKernels())
            assert isinstance(listed, KernelList) and len(listed.kernels) == 1
            reply = await client.execute_interactive("print(6 * 7)", timeout=DEADLINE)
            assert reply["content"]["status"] == "ok"
        finally:
            client.stop_channels()
            await km.shutdown_kernel()
