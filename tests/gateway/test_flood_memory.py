"""The gateway's memory while a kernel floods stdout to a client that reads nothing: at most
the client's backlog bound (``[gateway] client_backlog_mib``) and a constant.

The peak is the gateway process's own high-water mark (``VmHWM``, reset through
``/proc/PID/clear_refs`` before the flood), so no short spike is missed between samples.
Before the replica cut stream messages to 1 Mi characters and the front passed output
through unparsed, ipykernel's messages of tens of MiB each sat in the gateway in several
copies at once: this flood raised its peak by 270-400 MiB (the bound is 16).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from tornado import httpclient, websocket

from tests.agent._daemons import DEADLINE
from tests.gateway._http import KernelSocket, call, start_http_gateway, stdout, stop

# A flood of 96 MiB through a gateway on a loaded machine: a minute or more.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900), pytest.mark.long]

TOKEN = "flood-memory-secret"
BACKLOG_MIB = 16
#: What the gateway may hold past the bound: the messages on their way through it (each at
#: most a MiB), ZeroMQ's queues and the allocator's slack. Measured: 33 MiB here (bound 16),
#: 30-40 MiB past the default bound of 256 MiB.
ALLOWANCE_MIB = 64
FLOOD_MIB = 96
FLOOD = f"for _ in range({FLOOD_MIB * 1024}):\n    print({'x' * 1023!r})"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, int]]:
    extra = {"NBOS_GATEWAY__CLIENT_BACKLOG_MIB": str(BACKLOG_MIB)}
    process, url, log = start_http_gateway(tmp_path, TOKEN, extra)
    yield url, process.pid
    stop(process)
    assert process.returncode == 0, log.read_text()


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of process ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


async def wait_state(url: str, kernel_id: str, state: str) -> None:
    with anyio.fail_after(4 * DEADLINE):
        while True:
            _, model = await call(f"{url}/api/kernels/{kernel_id}", token=TOKEN)
            if model["execution_state"] == state:
                return
            await anyio.sleep(0.05)


async def test_a_flood_to_a_client_that_reads_nothing_holds_the_gateway_to_its_bound(
    gateway: tuple[str, int],
) -> None:
    url, pid = gateway
    _, model = await call(f"{url}/api/kernels", "POST", {}, token=TOKEN)
    kernel_id = model["id"]
    request = httpclient.HTTPRequest(
        f"{url}/api/kernels/{kernel_id}/channels?session_id=stalled".replace("http", "ws", 1),
        headers={"Authorization": f"token {TOKEN}"},
        request_timeout=DEADLINE,
    )
    conn = await websocket.websocket_connect(request, max_message_size=1 << 31)
    stalled = KernelSocket(conn, v1=False)
    try:
        assert (await stalled.run("pass"))[0]["content"]["status"] == "ok"
        reset_peak(pid)
        before = memory_kib(pid)["VmRSS"]
        # Sent, then not read until the cell is over (the gateway's REST API says when).
        flood_id = stalled.send("shell", "execute_request", {"code": FLOOD, "silent": False})
        await wait_state(url, kernel_id, "busy")
        await wait_state(url, kernel_id, "idle")
        grew_mib = (memory_kib(pid)["VmHWM"] - before) / 1024
        reply, outputs = await stalled.finish(flood_id, timeout=4 * DEADLINE)
    finally:
        stalled.close()
    assert reply["content"]["status"] == "ok"
    # The bound was reached: output past it was dropped.
    assert 0 < len(stdout(outputs)) < FLOOD_MIB * 2**20
    assert grew_mib <= BACKLOG_MIB + ALLOWANCE_MIB, f"the gateway grew {grew_mib:.0f} MiB"
