"""A cell that prints a flood of stdout, to a WebSocket client: nbos against Jupyter Kernel
Gateway, through the same client.

Starts ``nbos gateway --http`` (3 local agents) and Jupyter Kernel Gateway 3 in front of a
plain ipykernel (its IOPub rate limit off, so that it sends all the output: by default it
drops stream output past 1 MB/s), then, alternating the two for ``NBOS_BENCH_ROUNDS`` rounds
(default 3), runs a cell printing ``NBOS_BENCH_FLOOD_MB`` MiB (default 100) in 1 KiB lines
and times it from ``execute_request`` until its reply and ``idle`` arrived, every line
counted at the client. Throughput: MiB of stdout the client got per second. Each server's
peak memory through the cell, over what it held idle before the first flood: RSS (the
kernel's high-water mark, reset before the cell) and PSS (sampled).

Then a **slow client** on each: it sends a cell printing ``NBOS_BENCH_SLOW_MB`` MiB
(default 320) and reads nothing for ``NBOS_BENCH_STALL_S`` seconds (default 20), the
server's peak memory meanwhile, then reads what still comes. nbos's gateway holds at most
its per-client backlog (``[gateway] client_backlog_mib``, default 256) for a client that
does not read, and drops its output past it; Kernel Gateway holds everything. Run as the
servers' owner (it writes their ``/proc/PID/clear_refs``).

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


class MemoryPeak:
    """Process ``pid``'s peak memory while in the block, over ``idle`` (its RSS and PSS in
    KiB when it served no flood yet), in MiB.

    RSS: the kernel's own high-water mark (``VmHWM``, reset through ``clear_refs`` on
    entry), so that no spike is missed between samples; PSS (``smaps_rollup``, what the
    process's pages cost when shared pages are split among their users) sampled every
    50 ms. Over the idle figures, not over the block's start: an allocator keeps what a
    process once held, and a peak that reuses it is still a peak.
    """

    def __init__(self, pid: int, idle: tuple[int, int]) -> None:
        self.pid = pid
        self.idle = idle
        self.rss_peak, self.pss_peak = idle
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.pss_peak = max(self.pss_peak, _pss_kib(self.pid))

    def __enter__(self) -> MemoryPeak:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM from now on
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.rss_peak = _status_kib(self.pid, "VmHWM")
        self.pss_peak = max(self.pss_peak, _pss_kib(self.pid))

    @property
    def rss_grew_mib(self) -> float:
        return round((self.rss_peak - self.idle[0]) / 1024, 1)

    @property
    def pss_grew_mib(self) -> float:
        return round((self.pss_peak - self.idle[1]) / 1024, 1)


def idle_memory(pid: int) -> tuple[int, int]:
    """RSS and PSS of ``pid``, in KiB."""
    return _status_kib(pid, "VmRSS"), _pss_kib(pid)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for {pid}")


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


async def flood(
    base: str, kernel_id: str, pid: int, idle: tuple[int, int]
) -> tuple[float, MemoryPeak]:
    """One flood cell: MiB/s of stdout at the client, and the server's peak memory."""
    conn = await open_ws(base, kernel_id)
    try:
        with MemoryPeak(pid, idle) as memory:
            begun = time.perf_counter()
            got, whole = await read_cell(conn, send_cell(conn, flood_code(FLOOD_MIB)))
            took = time.perf_counter() - begun
    finally:
        conn.close()
    expected = int(FLOOD_MIB * 1024 * 1024 / LINE) * LINE
    if not whole or got != expected:
        raise SystemExit(f"{base}: the client got {got} of {expected} bytes (whole: {whole})")
    return got / 2**20 / took, memory


async def slow_client(
    base: str, kernel_id: str, pid: int, idle: tuple[int, int]
) -> dict[str, object]:
    """The flood to a client that reads nothing for ``STALL_S``: peak memory meanwhile, and
    what the client got once it read again (nbos drops IOPub past its bound, maybe the
    ``idle`` too: then the reply is waited for and 30 s of silence)."""
    conn = await open_ws(base, kernel_id)
    try:
        msg_id = send_cell(conn, flood_code(SLOW_MIB))
        with MemoryPeak(pid, idle) as memory:
            await anyio.sleep(STALL_S)
        got, whole = await read_cell(conn, msg_id, quiet_s=30.0)
    finally:
        conn.close()
    return {
        "rss_grew_mib": memory.rss_grew_mib,
        "pss_grew_mib": memory.pss_grew_mib,
        "got_mib": round(got / 2**20, 1),
        "whole": whole,
    }


async def main(servers: dict[str, tuple[str, int, str]]) -> dict[str, object]:
    kernels = {name: await new_kernel(url, spec) for name, (url, _, spec) in servers.items()}
    figures: dict[str, object] = {"flood_mib": FLOOD_MIB, "rounds": ROUNDS, "slow_mib": SLOW_MIB}
    idle = {name: idle_memory(pid) for name, (_, pid, _) in servers.items()}
    rates: dict[str, list[float]] = {name: [] for name in servers}
    peaks: dict[str, list[MemoryPeak]] = {name: [] for name in servers}
    for _ in range(ROUNDS):
        for name, (url, pid, _) in servers.items():
            rate, memory = await flood(url, kernels[name], pid, idle[name])
            rates[name].append(rate)
            peaks[name].append(memory)
            print(
                f"flood {name:15} {rate:7.1f} MiB/s  server peak RSS +{memory.rss_grew_mib} "
                f"MiB, PSS +{memory.pss_grew_mib} MiB",
                flush=True,
            )
    for name, (url, pid, _) in servers.items():
        slow = await slow_client(url, kernels[name], pid, idle[name])
        figures[f"{name}_slow_client"] = slow
        print(f"slow  {name:15} {slow}", flush=True)
    for name in servers:
        figures[f"{name}_mib_s"] = round(statistics.median(rates[name]), 1)
        figures[f"{name}_rounds_mib_s"] = [round(r, 1) for r in rates[name]]
        figures[f"{name}_rss_growth_mib"] = max(p.rss_grew_mib for p in peaks[name])
        figures[f"{name}_pss_growth_mib"] = max(p.pss_grew_mib for p in peaks[name])
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
        "WebSocket client (median of the rounds); nbos gateway peak growth (MiB, most of "
        f"the rounds): RSS {figures['nbos_rss_growth_mib']}, PSS "
        f"{figures['nbos_pss_growth_mib']}; a client not reading {SLOW_MIB:g} MiB: "
        f"{figures['nbos_slow_client']}",
        "unit": "MiB/s",
        "value": value,
        "anchor": "Jupyter Kernel Gateway 3 + ipykernel, same client, its rate limit off; "
        f"its peak growth RSS {figures['kernel-gateway_rss_growth_mib']}, PSS "
        f"{figures['kernel-gateway_pss_growth_mib']} MiB; a client not reading: "
        f"{figures['kernel-gateway_slow_client']}",
        "anchor_value": anchor,
        "ratio": round(value / anchor, 3),
        "better": "higher",
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nbos-bench-flood-") as tmp:
        figures = run(Path(tmp))
    print(json.dumps(figures))
    print(json.dumps(closing_line(figures)))
