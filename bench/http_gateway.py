"""The Kernel Gateway API, side by side with Jupyter Kernel Gateway, through the same client.

Starts ``nbos gateway --http`` (3 local agents) and Jupyter Kernel Gateway 3 (``python
-m kernel_gateway``) in front of plain ipykernels (the ``python3`` kernelspec), then
measures, alternating the two in rounds so that machine noise hits both alike:

* **a trivial cell** (``pass``) round trip, from sending ``execute_request`` until both
  its reply and its ``idle`` arrived, by these paths:

  - ``nbos-ws``: the gateway's WebSocket, legacy JSON protocol (what Jupyter Server's
    gateway client speaks);
  - ``nbos-ws-v1``: the same in ``v1.kernel.websocket.jupyter.org`` (what JupyterLab
    speaks to a server that offers it);
  - ``nbos-zmq``: the same nbos kernel's front directly over ZeroMQ
    (``AsyncKernelClient``): the goal is ``nbos-ws`` within +1 ms of it at p50;
  - ``kernel-gateway``: Kernel Gateway's WebSocket on its ipykernel, same client and
    protocol as ``nbos-ws``.

  Paths alternate in blocks of ``NBOS_BENCH_BLOCK`` cells (default 20) for
  ``NBOS_BENCH_ROUNDS`` rounds (default 10), after warm-up cells.
* **a kernel start**: ``POST /api/kernels``, the WebSocket opened and the first cell's
  reply and ``idle`` (then the kernel is deleted), ``NBOS_BENCH_STARTS`` times on each
  (default 5), alternating.

Prints p50/p99 of each, then a JSON object of every figure; the last line is the JSON
summary (``nbos-ws`` p50 against the same kernel's ZeroMQ path). Run from the repository
root: ``python bench/http_gateway.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from jupyter_client.asynchronous.client import AsyncKernelClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbos.gateway.control_api import KernelList, ListKernels
from nbos.gateway.control_api import call as control_call
from nbos.transport.ports import free_loopback_ports
from tests.gateway._http import KernelSocket, call, start_http_gateway, stop, wait_listening

BLOCK = int(os.environ.get("NBOS_BENCH_BLOCK", "20"))
ROUNDS = int(os.environ.get("NBOS_BENCH_ROUNDS", "10"))
STARTS = int(os.environ.get("NBOS_BENCH_STARTS", "5"))
TOKEN = "bench-gateway"

Cell = Callable[[], Awaitable[None]]


def over_ws(ws: KernelSocket) -> Cell:
    async def cell() -> None:
        reply, _ = await ws.run("pass")
        assert reply["content"]["status"] == "ok"

    return cell


def over_zmq(client: AsyncKernelClient) -> Cell:
    async def cell() -> None:
        reply = await client.execute_interactive("pass", timeout=60)
        assert reply["content"]["status"] == "ok"

    return cell


def start_kernel_gateway(
    tmp: Path, options: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """Jupyter Kernel Gateway on a free loopback port, its kernels plain ipykernels;
    ``options``: more of its command line (``--Class.trait=value``)."""
    (port,) = free_loopback_ports(1)
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_DATA_DIR": str(tmp / "data"),
    }
    argv = [
        sys.executable,
        "-m",
        "kernel_gateway",
        "--KernelGatewayApp.ip=127.0.0.1",
        f"--KernelGatewayApp.port={port}",
        "--KernelGatewayApp.port_retries=0",
        f"--KernelGatewayApp.auth_token={TOKEN}",
        "--KernelGatewayApp.default_kernel_name=python3",
        *options,
    ]
    log = tmp / "kernel-gateway.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env
        )
    url = f"http://127.0.0.1:{port}"
    wait_listening(process, f"{url}/api?token={TOKEN}", log)
    return process, url


async def new_kernel(base: str, name: str) -> str:
    code, model = await call(f"{base}/api/kernels", "POST", {"name": name}, token=TOKEN)
    assert code == 201, model
    return str(model["id"])


async def open_socket(base: str, kernel_id: str, *, v1: bool = False) -> KernelSocket:
    return await KernelSocket.open(f"{base}/api/kernels/{kernel_id}/channels", TOKEN, v1=v1)


async def zmq_client(base: str, control: str, kernel_id: str) -> AsyncKernelClient:
    """A ZeroMQ client of the nbos kernel front behind the API's kernel ``kernel_id``."""
    nbos_id = (await call(f"{base}/api/kernels/{kernel_id}", token=TOKEN))[1]["nbos"]["kernel_id"]
    listed = await control_call(control, ListKernels(), timeout=30, token=TOKEN)
    assert isinstance(listed, KernelList)
    info = next(k for k in listed.kernels if k.kernel_id == nbos_id)
    client = AsyncKernelClient()
    client.load_connection_info(dict(info.connection))
    client.start_channels()
    return client


async def start_to_first_reply(base: str, name: str) -> float:
    """Seconds from ``POST /api/kernels`` to its first cell's reply and idle; deletes it."""
    begun = time.perf_counter()
    kernel_id = await new_kernel(base, name)
    ws = await open_socket(base, kernel_id)
    try:
        await over_ws(ws)()
        took = time.perf_counter() - begun
    finally:
        ws.close()
    code, _ = await call(f"{base}/api/kernels/{kernel_id}", "DELETE", token=TOKEN)
    assert code == 204, code
    return took


async def cells(paths: dict[str, Cell]) -> dict[str, list[float]]:
    """Milliseconds of each path's cells, the paths alternating in blocks."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for cell in paths.values():
        for _ in range(5):
            await cell()
    for _ in range(ROUNDS):
        for name, cell in paths.items():
            for _ in range(BLOCK):
                begun = time.perf_counter()
                await cell()
                times[name].append((time.perf_counter() - begun) * 1e3)
    return times


def quantiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99."""
    return statistics.median(samples), statistics.quantiles(samples, n=100)[98]


async def main(nbos: str, control: str, kg: str) -> dict[str, object]:
    nbos_id, kg_id = await new_kernel(nbos, "nbos"), await new_kernel(kg, "python3")
    client = await zmq_client(nbos, control, nbos_id)
    try:
        times = await cells(
            {
                "nbos-ws": over_ws(await open_socket(nbos, nbos_id)),
                "nbos-ws-v1": over_ws(await open_socket(nbos, nbos_id, v1=True)),
                "nbos-zmq": over_zmq(client),
                "kernel-gateway": over_ws(await open_socket(kg, kg_id)),
            }
        )
    finally:
        client.stop_channels()
    # After the cells: a start makes the warm pool refill, which takes CPU from cells.
    starts: dict[str, list[float]] = {"nbos": [], "kernel-gateway": []}
    for _ in range(STARTS):
        starts["nbos"].append(await start_to_first_reply(nbos, "nbos"))
        starts["kernel-gateway"].append(await start_to_first_reply(kg, "python3"))
    figures: dict[str, object] = {"cells_per_path": len(times["nbos-ws"])}
    for name, samples in times.items():
        p50, p99 = quantiles(samples)
        figures[f"{name}_p50_ms"], figures[f"{name}_p99_ms"] = round(p50, 2), round(p99, 2)
        print(f"cell  {name:15} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms")
    for name, seconds in starts.items():
        p50 = statistics.median(seconds)
        figures[f"{name}_start_p50_s"] = round(p50, 3)
        figures[f"{name}_start_s"] = [round(s, 3) for s in seconds]
        print(f"start {name:15} p50 {p50:7.3f} s   all {figures[f'{name}_start_s']}")
    figures["nbos-ws_over_zmq_p50_ms"] = round(
        float(str(figures["nbos-ws_p50_ms"])) - float(str(figures["nbos-zmq_p50_ms"])), 2
    )
    figures["start_ratio_to_kernel_gateway"] = round(
        float(str(figures["nbos_start_p50_s"])) / float(str(figures["kernel-gateway_start_p50_s"])),
        3,
    )
    return figures


def run(tmp: Path) -> dict[str, object]:
    for sub in ("gateway", "kernel-gateway"):
        (tmp / sub).mkdir()
    gateway, nbos_url, gw_log = start_http_gateway(tmp / "gateway", TOKEN)
    servers = [gateway]
    try:
        kernel_gateway, kg_url = start_kernel_gateway(tmp / "kernel-gateway")
        servers.append(kernel_gateway)
        control = gw_log.read_text().split("control at tcp://")[1].split(",")[0]
        return anyio.run(main, nbos_url, control, kg_url)
    finally:
        for process in reversed(servers):
            stop(process)


def closing_line(figures: dict[str, object]) -> dict[str, object]:
    """The summary every benchmark ends with: the trivial cell over the gateway's WebSocket
    against the same kernel over ZeroMQ, p50 (the goal: within +1 ms)."""
    value = float(str(figures["nbos-ws_p50_ms"]))
    anchor = float(str(figures["nbos-zmq_p50_ms"]))
    return {
        "bench": "http_gateway",
        "metric": "trivial cell round trip p50 over the gateway's WebSocket (JSON protocol)",
        "unit": "ms",
        "value": value,
        "anchor": "the same nbos kernel's cell over its ZeroMQ connection (p50); "
        f"Jupyter Kernel Gateway 3 + ipykernel: {figures['kernel-gateway_p50_ms']} ms",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-http-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
