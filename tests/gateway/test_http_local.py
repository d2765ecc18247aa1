"""The Kernel Gateway API over an embedded cluster, in this process: culling, TLS, settings."""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

import anyio
import msgspec
import pytest
from tornado import httpclient

from nbos.cluster import LocalCluster
from nbos.core.config import GatewaySettings
from nbos.core.errors import ConfigError
from nbos.gateway.auth import Authenticator
from nbos.gateway.http import serve_http
from tests.gateway._http import KernelSocket, call, poll, stdout

pytestmark = pytest.mark.anyio


def accepted_socket(peer: tuple[str, int]) -> socket.socket:
    """This process's TCP socket connected to ``peer``: the server's end of a connection."""
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:
            continue  # closed since listed
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[:2] == peer:
                return sock
        except OSError:
            pass  # not connected
        sock.close()
    raise LookupError(f"no socket connected to {peer}")


async def test_a_kernel_without_clients_is_culled_once_idle_and_one_with_a_client_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nbos.gateway.http")
    # Long enough for the kept kernel's client to connect on a loaded machine.
    conf = GatewaySettings(http_address="127.0.0.1:0", cull_idle_timeout=5.0)
    async with (
        LocalCluster(3, run_dir=tmp_path) as cluster,
        serve_http(conf, cluster.kernel_manager, lambda: 0, Authenticator("t")) as api,
    ):
        kernels = f"{api.url}/api/kernels"
        kept = (await call(kernels, "POST", {}, token="t"))[1]["id"]
        ws = await KernelSocket.open(f"{kernels}/{kept}/channels", "t")
        culled = (await call(kernels, "POST", {"name": "nbos"}, token="t"))[1]["id"]
        try:

            async def gone() -> bool:
                return (await call(f"{kernels}/{culled}", token="t"))[0] == 404

            await poll(gone)
            assert [k["id"] for k in (await call(kernels, token="t"))[1]] == [kept]
            assert (await ws.run("print('still here')"))[0]["content"]["status"] == "ok"
        finally:
            ws.close()
        assert f"kernel {culled} idle for" in caplog.text

        async def shut_down() -> bool:
            # The API forgets a culled kernel at once and shuts it down after: on a
            # loaded machine the gateway may still be stopping its replicas here.
            return [k.kernel_id for k in cluster.kernel_manager.kernels] == [kept]

        await poll(shut_down)
        assert f"kernel {culled} shut down" in caplog.text


async def test_tls_when_a_certificate_is_configured_and_bad_settings_refused(
    tmp_path: Path,
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await anyio.run_process(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ]
    )
    conf = GatewaySettings(
        http_address="127.0.0.1:0", auth_token="t", http_certfile=str(cert), http_keyfile=str(key)
    )
    async with (
        LocalCluster(3, run_dir=tmp_path / "cluster") as cluster,
        serve_http(conf, cluster.kernel_manager, lambda: 4, Authenticator("t")) as api,
    ):
        assert api.url.startswith("https://127.0.0.1:")
        response = await httpclient.AsyncHTTPClient().fetch(
            f"{api.url}/api/kernelspecs",
            headers={"Authorization": "token t"},
            ca_certs=str(cert),
        )
        names = list(msgspec.json.decode(response.body)["kernelspecs"])
        assert names == ["nbos", "nbos-gpu-1", "nbos-gpu-2", "nbos-gpu-4"]
        with pytest.raises(httpclient.HTTPClientError) as refused:
            await httpclient.AsyncHTTPClient().fetch(f"{api.url}/api", ca_certs=str(cert))
        assert refused.value.code == 401
        for bad in (
            {"http_address": "nowhere"},
            {"http_certfile": str(tmp_path / "missing.pem")},
            {"http_certfile": "", "http_keyfile": str(key)},
            {"cull_idle_timeout": -1.0},
        ):
            with pytest.raises(ConfigError):
                async with serve_http(
                    msgspec.structs.replace(conf, **bad),
                    cluster.kernel_manager,
                    lambda: 0,
                    Authenticator("t"),
                ):
                    pass


async def test_the_websocket_sends_a_cells_messages_without_waiting_for_acks(
    tmp_path: Path,
) -> None:
    """Nagle's algorithm held every message after a cell's first ``busy`` until the
    client's delayed ACK (40 ms a cell): the server's end of the WebSocket has
    ``TCP_NODELAY`` set, after the upgrade (whose end turns it off) and after a cell."""
    conf = GatewaySettings(http_address="127.0.0.1:0")
    async with (
        LocalCluster(3, run_dir=tmp_path) as cluster,
        serve_http(conf, cluster.kernel_manager, lambda: 0, Authenticator("t")) as api,
    ):
        kernels = f"{api.url}/api/kernels"
        kernel_id = (await call(kernels, "POST", {}, token="t"))[1]["id"]
        for v1 in (False, True):
            ws = await KernelSocket.open(f"{kernels}/{kernel_id}/channels", "t", v1=v1)
            try:
                reply, outputs = await ws.run("print('hi')")
                assert reply["content"]["status"] == "ok"
                assert stdout(outputs) == "hi\n"
                client = ws.conn.protocol.stream.socket
                assert client is not None
                with accepted_socket(client.getsockname()[:2]) as server:
                    assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            finally:
                ws.close()
