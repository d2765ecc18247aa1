"""Cell round trips through the Kernel Gateway API, against the same cell without it.

Starts ``nbos gateway --http`` (3 local agents), a Jupyter Server pointed at it
(``--gateway-url``) and a plain Jupyter Server with its own local ``python3`` kernel,
then times a trivial cell (``pass``) by the paths a notebook can take:

* ``jupyter+gateway``: Jupyter Server's WebSocket, its gateway client, the gateway's
  WebSocket bridge, the nbos kernel front (what JupyterLab with ``--gateway-url`` does);
* ``gateway-json`` / ``gateway-v1``: the gateway's WebSocket directly, in the legacy
  JSON protocol and in ``v1.kernel.websocket.jupyter.org``;
* ``zmq``: the same nbos kernel's front directly over ZeroMQ (``AsyncKernelClient``);
* ``jupyter+local``: the plain Jupyter Server's WebSocket on its local ``python3``
  kernel (the anchor of the goal: ``jupyter+gateway`` within +5 ms at p50).

A round trip runs from sending ``execute_request`` until both its reply and its
``idle`` arrived. Paths alternate in blocks of ``NBOS_BENCH_BLOCK`` cells (default 20)
for ``NBOS_BENCH_ROUNDS`` rounds (default 5), after warm-up cells, so machine noise hits
all alike. Kernel start times through Jupyter Server are printed too, then a JSON object
of every figure; the last line is the JSON summary (Jupyter Server + gateway against
Jupyter Server on its local kernel, p50). Run from the repository root:
``python bench/http_gateway.py``.
"""

from __future__ import annotations

import json
import os
import statistics
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
from tests.gateway._http import (
    KernelSocket,
    call,
    start_http_gateway,
    start_jupyter_server,
    stop,
)

BLOCK = int(os.environ.get("NBOS_BENCH_BLOCK", "20"))
ROUNDS = int(os.environ.get("NBOS_BENCH_ROUNDS", "5"))
TOKEN, JTOKEN = "bench-gateway", "bench-jupyter"

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


async def start_kernel(jupyter: str, name: str) -> tuple[str, float]:
    begun = time.perf_counter()
    code, model = await call(f"{jupyter}/api/kernels", "POST", {"name": name}, token=JTOKEN)
    assert code == 201, model
    return model["id"], time.perf_counter() - begun


def socket_url(base: str, kernel_id: str, token: str) -> str:
    return f"{base}/api/kernels/{kernel_id}/channels?token={token}"


async def main(gw_url: str, control: str, js_url: str, local_url: str) -> dict[str, object]:
    starts = [(await start_kernel(js_url, "nbos"))[1] for _ in range(2)]
    kernel_id, start_s = await start_kernel(js_url, "nbos")
    starts.append(start_s)
    local_id, local_start_s = await start_kernel(local_url, "python3")
    nbos_id = (await call(f"{gw_url}/api/kernels/{kernel_id}", token=TOKEN))[1]["nbos"]["kernel_id"]
    listed = await control_call(control, ListKernels(), timeout=30)
    assert isinstance(listed, KernelList)
    info = next(k for k in listed.kernels if k.kernel_id == nbos_id)
    client = AsyncKernelClient()
    client.load_connection_info(dict(info.connection))
    client.start_channels()
    paths: dict[str, Cell] = {
        "jupyter+gateway": over_ws(await KernelSocket.open(socket_url(js_url, kernel_id, JTOKEN))),
        "gateway-json": over_ws(await KernelSocket.open(socket_url(gw_url, kernel_id, TOKEN))),
        "gateway-v1": over_ws(
            await KernelSocket.open(socket_url(gw_url, kernel_id, TOKEN), v1=True)
        ),
        "zmq": over_zmq(client),
        "jupyter+local": over_ws(await KernelSocket.open(socket_url(local_url, local_id, JTOKEN))),
    }
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
    client.stop_channels()
    summary: dict[str, object] = {
        "nbos_kernel_start_s": [round(s, 2) for s in starts],
        "local_kernel_start_s": round(local_start_s, 2),
    }
    for name, samples in times.items():
        q = statistics.quantiles(samples, n=10)
        summary[f"{name}_p50_ms"] = round(statistics.median(samples), 2)
        summary[f"{name}_p90_ms"] = round(q[8], 2)
        summary[f"{name}_p10_ms"] = round(q[0], 2)
        print(
            f"{name:16} p10 {q[0]:7.2f} ms  p50 {statistics.median(samples):7.2f} ms"
            f"  p90 {q[8]:7.2f} ms"
        )
    summary["gateway_overhead_p50_ms"] = round(
        float(summary["jupyter+gateway_p50_ms"]) - float(summary["jupyter+local_p50_ms"]), 2
    )
    return summary


def run(tmp: Path) -> dict[str, object]:
    for sub in ("gateway", "js-gateway", "js-local"):
        (tmp / sub).mkdir()
    gateway, gw_url, gw_log = start_http_gateway(tmp / "gateway", TOKEN)
    servers = [gateway]
    try:
        front_js, js_url, _ = start_jupyter_server(tmp / "js-gateway", gw_url, TOKEN, JTOKEN)
        servers.append(front_js)
        local_js, local_url, _ = start_jupyter_server(tmp / "js-local", None, "", JTOKEN)
        servers.append(local_js)
        control = gw_log.read_text().split("control at tcp://")[1].split(",")[0]
        return anyio.run(main, gw_url, control, js_url, local_url)
    finally:
        for process in reversed(servers):
            stop(process)


def closing_line(figures: dict[str, object]) -> dict[str, object]:
    """The summary every benchmark ends with: Jupyter Server + gateway against Jupyter
    Server with its own local kernel, p50 (the goal: within +5 ms)."""
    value = float(str(figures["jupyter+gateway_p50_ms"]))
    anchor = float(str(figures["jupyter+local_p50_ms"]))
    return {
        "bench": "http_gateway",
        "metric": "trivial cell round trip p50 through Jupyter Server + nbos gateway",
        "unit": "ms",
        "value": value,
        "anchor": "the same cell through Jupyter Server on its own local python3 kernel (p50)",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "lower",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-http-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
