"""Flow control on the gateway's WebSockets: a client that does not read while its kernel
floods stdout holds a bounded amount of the gateway's memory (its output past the bound is
dropped, and it is told so), and nothing else waits for it: the kernel's other client sees
the cell end, the kernel's control channel answers, another kernel runs cells."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from tornado import httpclient, websocket

from tests.agent._daemons import DEADLINE
from tests.gateway._http import KernelSocket, call, poll, start_http_gateway, stdout, stop

# Each floods a kernel with tens of MiB: over a minute on a loaded machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900), pytest.mark.long]

TOKEN = "flow-secret"
#: What a client may have not yet taken (``[gateway] client_backlog_mib``), small here.
BACKLOG_MIB = 8
#: Lines of 1 KiB the flooding cell prints: well past the bound and the sockets' buffers.
FLOOD_LINES = 4 * BACKLOG_MIB * 1024
FLOOD = f"for _ in range({FLOOD_LINES}):\n    print({'x' * 1023!r})"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[str]:
    extra = {"NBOS_GATEWAY__CLIENT_BACKLOG_MIB": str(BACKLOG_MIB)}
    process, url, log = start_http_gateway(tmp_path, TOKEN, extra)
    yield url
    stop(process)
    assert process.returncode == 0, log.read_text()


async def open_socket(url: str, kernel_id: str, session_id: str) -> KernelSocket:
    """A kernel's WebSocket that takes messages of any size (ipykernel batches a flood
    of lines into messages of megabytes)."""
    ws_url = f"{url}/api/kernels/{kernel_id}/channels?session_id={session_id}"
    request = httpclient.HTTPRequest(
        ws_url.replace("http", "ws", 1),
        headers={"Authorization": f"token {TOKEN}"},
        request_timeout=DEADLINE,
    )
    conn = await websocket.websocket_connect(request, max_message_size=1 << 31)
    return KernelSocket(conn, v1=False)


async def new_kernel(url: str) -> str:
    code, model = await call(f"{url}/api/kernels", "POST", {}, token=TOKEN)
    assert code == 201, model
    return str(model["id"])


async def follow(ws: KernelSocket, cell_id: str, control_id: str) -> tuple[str, bool]:
    """Cell ``cell_id``'s stdout as another client sees it, until its idle; and whether the
    control request ``control_id`` was answered meanwhile."""
    lines: list[str] = []
    idle = answered = False
    while not (idle and answered):
        msg = await ws.receive(timeout=4 * DEADLINE)
        parent = msg["parent_header"].get("msg_id")
        if parent == control_id and msg["channel"] == "control":
            answered = True
        elif parent == cell_id and msg["msg_type"] == "stream":
            lines.append(msg["content"]["text"])
        elif parent == cell_id and msg["msg_type"] == "status":
            idle = msg["content"]["execution_state"] == "idle"
    return "".join(lines), answered


async def run_into(
    ws: KernelSocket, code: str, into: list[tuple[dict[str, Any], list[dict[str, Any]]]]
) -> None:
    into.append(await ws.run(code))


async def test_a_client_that_does_not_read_loses_output_past_the_bound_and_stalls_nobody(
    gateway: str,
) -> None:
    url = gateway
    flooded, other = await new_kernel(url), await new_kernel(url)
    stalled = await open_socket(url, flooded, "stalled")
    reader = await open_socket(url, flooded, "reader")
    bystander = await open_socket(url, other, "bystander")
    try:
        assert (await reader.run("pass"))[0]["content"]["status"] == "ok"
        assert (await bystander.run("y = 6"))[0]["content"]["status"] == "ok"

        # The stalled client asks for the flood and reads nothing (tornado's client holds
        # one message and leaves the rest in the socket) until the flood is over.
        ran: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        flood_id = stalled.send("shell", "execute_request", {"code": FLOOD, "silent": False})
        control_id = reader.send("control", "kernel_info_request", {})
        with anyio.fail_after(4 * DEADLINE):
            async with anyio.create_task_group() as tg:
                # Another kernel runs a cell meanwhile.
                tg.start_soon(run_into, bystander, "print(y * 7)", ran)
                # The kernel's other client sees the cell's output and end, and the
                # kernel's control channel answers (a reader slower than the kernel may
                # lose output past the bound too: not every line is asserted).
                lines, answered = await follow(reader, flood_id, control_id)
        assert lines.startswith(f"{'x' * 1023}\n") and answered
        reply, outputs = ran[0]
        assert reply["content"]["status"] == "ok" and stdout(outputs) == "42\n"

        # The stalled client reads again: its cell's reply and idle came, a notice on
        # stderr, and not all of the output: what was past the bound was dropped.
        reply, outputs = await stalled.finish(flood_id, timeout=4 * DEADLINE)
        assert reply["content"]["status"] == "ok"
        got = stdout(outputs)
        assert 0 < len(got) < FLOOD_LINES * 1024, len(got)
        notices = [
            o["content"]["text"]
            for o in outputs
            if o["msg_type"] == "stream" and o["content"]["name"] == "stderr"
        ]
        assert len(notices) == 1 and "output dropped" in notices[0], notices
        # Its next cell's output is whole.
        reply, outputs = await stalled.run("print('caught up')")
        assert stdout(outputs) == "caught up\n"
    finally:
        for ws in (stalled, reader, bystander):
            ws.close()
    for kernel_id in (flooded, other):
        assert (await call(f"{url}/api/kernels/{kernel_id}", "DELETE", token=TOKEN))[0] == 204


async def test_a_session_away_during_a_flood_is_held_its_bound_of_the_newest_messages(
    gateway: str,
) -> None:
    url = gateway
    kernel_id = await new_kernel(url)
    away = await open_socket(url, kernel_id, "away")
    reader = await open_socket(url, kernel_id, "reader")
    try:
        assert (await away.run("pass"))[0]["content"]["status"] == "ok"
        flood_id = away.send("shell", "execute_request", {"code": FLOOD, "silent": False})
        away.close()  # mid-cell: the gateway holds the session's messages
        control_id = reader.send("control", "kernel_info_request", {})
        with anyio.fail_after(4 * DEADLINE):
            await follow(reader, flood_id, control_id)

        async def away_seen() -> bool:  # the gateway saw the close: the session is held
            return (await call(f"{url}/api/kernels/{kernel_id}", token=TOKEN))[1][
                "connections"
            ] == 1

        await poll(away_seen)
        back = await open_socket(url, kernel_id, "away")
        try:
            # What was held: the cell's end, and of its output only the newest part.
            reply, outputs = await back.finish(flood_id, timeout=4 * DEADLINE)
            assert reply["content"]["status"] == "ok"
            assert len(stdout(outputs)) < FLOOD_LINES * 1024, len(stdout(outputs))
            # ... and a line on stderr that says so.
            said = [o["content"]["text"] for o in outputs if o["msg_type"] == "stream"]
            assert any("dropped while this client was away" in t for t in said), said[:3]
        finally:
            back.close()
    finally:
        reader.close()
    assert (await call(f"{url}/api/kernels/{kernel_id}", "DELETE", token=TOKEN))[0] == 204
