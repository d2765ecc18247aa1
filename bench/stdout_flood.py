"""A cell that prints a flood of stdout, to a WebSocket client: nbos against Jupyter Kernel
Gateway, through the same client.

Starts ``nbos gateway --http`` (3 local agents) and Jupyter Kernel Gateway 3 in front of a
plain ipykernel (its IOPub rate limit off, so that it sends all the output: by default it
drops stream output past 1 MB/s), then, alternating the two for ``NBOS_BENCH_ROUNDS`` rounds
(default 3), runs a cell printing ``NBOS_BENCH_FLOOD_MB`` MiB (default 100) in 1 KiB lines
and times it from ``execute_request`` until its reply and ``idle`` arrived, every line
counted at the client. Throughput: MiB of stdout the client got per second. Each server's
memory (RSS) is sampled through the cell: its peak over the RSS before.

First a **slow client** on each: it sends a cell printing ``NBOS_BENCH_SLOW_MB`` MiB
(default 320) and reads nothing for ``NBOS_BENCH_STALL_S`` seconds (default 20), the
server's RSS sampled meanwhile, then reads what still comes. nbos's gateway holds at most
its per-client backlog (``[gateway] client_backlog_mib``, default 256) for a client that
does not read, and drops its output past it; Kernel Gateway holds everything.

The last line is the JSON summary: nbos's throughput against Kernel Gateway's (median of
the rounds). Run from the repository root: ``python bench/stdout_flood.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import msgspec
from http_gateway import TOKEN, new_kernel, start_kernel_gateway
from tornado import httpclient, websocket

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_client.session import Session

from tests.gateway._http import call, start_http_gateway, stop

FLOOD_MIB = float(os.environ.get("NBOS_BENCH_FLOOD_MB", "100"))
ROUNDS = int(os.environ.get("NBOS_BENCH_ROUNDS", "3"))
STALL_S = float(os.environ.get("NBOS_BENCH_STALL_S", "20"))
#: The slow client's flood: past nbos's default bound (256 MiB) and the sockets' buffers.
SLOW_MIB = float(os.environ.get("NBOS_BENCH_SLOW_MB", "320"))
LINE = 1024
#: Kernel Gateway's own default drops stream output past 1 MB/s: its best is without.
KG_OPTIONS = ("--ZMQChannelsWebsocketConnection.limit_rate=False",)


def flood_code(mib: float) -> str:
    lines = int(mib * 1024 * 1024 / LINE)
    return f"for _ in range({lines}):\n    print({'x' * (LINE - 1)!r})"


class RssPeak:
    """The highest RSS of ``pid`` (KiB) while in the block, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss_kib(pid)
        self.peak = self.before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, rss_kib(self.pid))

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_kib(self.pid))

    @property
    def grew_mib(self) -> float:
        return (self.peak - self.before) / 1024


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class _Frame(msgspec.Struct):
    msg_type: str = ""
    channel: str = ""
    parent_header: dict[str, object] = {}
    content: dict[str, object] = {}


_decode = msgspec.json.Decoder(_Frame).decode


async def open_ws(base: str, kernel_id: str) -> websocket.WebSocketClientConnection:
    url = f"{base}/api/kernels/{kernel_id}/channels".replace("http", "ws", 1)
    request = httpclient.HTTPRequest(url, headers={"Authorization": f"token {TOKEN}"})
    return await websocket.websocket_connect(request, max_message_size=1 << 31)


def send_cell(conn: websocket.WebSocketClientConnection, code: str) -> str:
    msg = Session(key=b"").msg("execute_request", {"code": code, "silent": False})
    msg["channel"] = "shell"
    conn.write_message(json.dumps(msg, default=str))
    return str(msg["header"]["msg_id"])


async def read_cell(
    conn: websocket.WebSocketClientConnection, msg_id: str, quiet_s: float = 300.0
) -> tuple[int, bool]:
    """Stdout bytes of cell ``msg_id`` and whether its reply and idle both came, reading
    until they did or nothing came for ``quiet_s`` seconds."""
    got, replied, idle = 0, False, False
    while not (replied and idle):
        with anyio.move_on_after(quiet_s):
            frame = await conn.read_message()
        if frame is None or not isinstance(frame, str | bytes):
            break
        msg = _decode(frame)
        if msg.parent_header.get("msg_id") != msg_id:
            continue
        if msg.channel == "shell":
            replied = True
        elif msg.msg_type == "status":
            idle = msg.content.get("execution_state") == "idle"
        elif msg.msg_type == "stream":
            got += len(str(msg.content.get("text", "")))
    return got, replied and idle


async def flood(base: str, kernel_id: str, pid: int) -> tuple[float, float]:
    """One flood cell: MiB/s of stdout at the client, and the server's RSS growth (MiB)."""
    conn = await open_ws(base, kernel_id)
    try:
        with RssPeak(pid) as rss:
            begun = time.perf_counter()
            got, whole = await read_cell(conn, send_cell(conn, flood_code(FLOOD_MIB)))
            took = time.perf_counter() - begun
    finally:
        conn.close()
    expected = int(FLOOD_MIB * 1024 * 1024 / LINE) * LINE
    if not whole or got != expected:
        raise SystemExit(f"{base}: the client got {got} of {expected} bytes (whole: {whole})")
    return got / 2**20 / took, rss.grew_mib


async def slow_client(base: str, kernel_id: str, pid: int) -> dict[str, object]:
    """The flood to a client that reads nothing for ``STALL_S``: RSS growth meanwhile, and
    what the client got once it read again (nbos drops IOPub past its bound, maybe the
    ``idle`` too: then the reply is waited for and 30 s of silence)."""
    conn = await open_ws(base, kernel_id)
    try:
        msg_id = send_cell(conn, flood_code(SLOW_MIB))
        with RssPeak(pid) as rss:
            await anyio.sleep(STALL_S)
        got, whole = await read_cell(conn, msg_id, quiet_s=30.0)
    finally:
        conn.close()
    return {"grew_mib": round(rss.grew_mib, 1), "got_mib": round(got / 2**20, 1), "whole": whole}


async def main(servers: dict[str, tuple[str, int, str]]) -> dict[str, object]:
    kernels = {name: await new_kernel(url, spec) for name, (url, _, spec) in servers.items()}
    figures: dict[str, object] = {"flood_mib": FLOOD_MIB, "rounds": ROUNDS, "slow_mib": SLOW_MIB}
    # First, while the servers' memory is fresh: RSS once grown stays so when freed.
    for name, (url, pid, _) in servers.items():
        slow = await slow_client(url, kernels[name], pid)
        figures[f"{name}_slow_client"] = slow
        print(f"slow  {name:15} {slow}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in servers}
    grew: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(ROUNDS):
        for name, (url, pid, _) in servers.items():
            rate, mib = await flood(url, kernels[name], pid)
            rates[name].append(rate)
            grew[name].append(mib)
            print(f"flood {name:15} {rate:7.1f} MiB/s  server RSS +{mib:6.1f} MiB", flush=True)
    for name in servers:
        figures[f"{name}_mib_s"] = round(statistics.median(rates[name]), 1)
        figures[f"{name}_rounds_mib_s"] = [round(r, 1) for r in rates[name]]
        figures[f"{name}_rss_growth_mib"] = round(max(grew[name]), 1)
    for name, (url, _, _) in servers.items():
        await call(f"{url}/api/kernels/{kernels[name]}", "DELETE", token=TOKEN)
    return figures


def run(tmp: Path) -> dict[str, object]:
    for sub in ("gateway", "kernel-gateway"):
        (tmp / sub).mkdir()
    gateway, nbos_url, _ = start_http_gateway(tmp / "gateway", TOKEN)
    processes = [gateway]
    try:
        kernel_gateway, kg_url = start_kernel_gateway(tmp / "kernel-gateway", KG_OPTIONS)
        processes.append(kernel_gateway)
        servers = {
            "nbos": (nbos_url, gateway.pid, "nbos"),
            "kernel-gateway": (kg_url, kernel_gateway.pid, "python3"),
        }
        return anyio.run(main, servers)
    finally:
        for process in reversed(processes):
            stop(process)


def closing_line(figures: dict[str, object]) -> dict[str, object]:
    value = float(str(figures["nbos_mib_s"]))
    anchor = float(str(figures["kernel-gateway_mib_s"]))
    return {
        "bench": "stdout_flood",
        "metric": f"stdout of a cell printing {FLOOD_MIB:g} MiB in 1 KiB lines, to the "
        "WebSocket client (median of the rounds); nbos gateway RSS growth "
        f"{figures['nbos_rss_growth_mib']} MiB; a client not reading {SLOW_MIB:g} MiB: "
        f"{figures['nbos_slow_client']}",
        "unit": "MiB/s",
        "value": value,
        "anchor": "Jupyter Kernel Gateway 3 + ipykernel, same client, its rate limit off; "
        f"its RSS growth {figures['kernel-gateway_rss_growth_mib']} MiB; a client not "
        f"reading: {figures['kernel-gateway_slow_client']}",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "higher",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-flood-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
