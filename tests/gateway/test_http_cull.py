"""``[gateway] cull_idle_timeout``: the API over an embedded cluster, in this process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nbos.cluster import LocalCluster
from nbos.core.config import GatewaySettings
from nbos.gateway.http import serve_http
from tests.gateway._http import KernelSocket, call, poll

pytestmark = pytest.mark.anyio


async def test_a_kernel_without_clients_is_culled_once_idle_and_one_with_a_client_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nbos.gateway.http")
    # Long enough for the kept kernel's client to connect on a loaded machine.
    conf = GatewaySettings(http_address="127.0.0.1:0", cull_idle_timeout=5.0)
    async with (
        LocalCluster(3, run_dir=tmp_path) as cluster,
        serve_http(conf, cluster.gateway, lambda: 0) as api,
    ):
        kernels = f"{api.url}/api/kernels"
        kept = (await call(kernels, "POST", {}))[1]["id"]
        ws = await KernelSocket.open(f"{kernels}/{kept}/channels")
        culled = (await call(kernels, "POST", {"name": "nbos"}))[1]["id"]
        try:

            async def gone() -> bool:
                return (await call(f"{kernels}/{culled}"))[0] == 404

            await poll(gone)
            assert [k["id"] for k in (await call(kernels))[1]] == [kept]
            assert (await ws.run("print('still here')"))[0]["content"]["status"] == "ok"
        finally:
            ws.close()
        assert f"kernel {culled} idle for" in caplog.text
        assert [k.kernel_id for k in cluster.gateway.kernels] == [kept]
