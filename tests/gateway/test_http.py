"""The Kernel Gateway API of ``nbos gateway --http``: directly, and through a real
``jupyter server --gateway-url`` (Jupyter Server's own gateway client), one gateway
(3 local agents, 2 virtual GPUs each) and one Jupyter Server for the module."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from tornado import httpclient

from tests.agent._daemons import DEADLINE
from tests.gateway._http import (
    KernelSocket,
    call,
    huge_body_status,
    kinds,
    poll,
    start_http_gateway,
    start_jupyter_server,
    stdout,
    stop,
)

# Starting a gateway and a Jupyter Server takes a minute on a loaded machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

TOKEN = "gateway-secret"
JUPYTER_TOKEN = "jupyter-secret"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    process, url, log = start_http_gateway(tmp_path_factory.mktemp("gateway"), TOKEN)
    yield url, log
    stop(process)
    assert process.returncode == 0, log.read_text()


@pytest.fixture(scope="module")
def jupyter(gateway: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url, _ = start_jupyter_server(
        tmp_path_factory.mktemp("jupyter"), gateway[0], TOKEN, JUPYTER_TOKEN
    )
    yield url
    stop(process)


async def test_tokens_bad_requests_and_unknown_names_get_the_answers_jupyter_expects(
    gateway: tuple[str, Path],
) -> None:
    url, log = gateway
    assert (await call(f"{url}/api/kernels"))[0] == 401
    assert (await call(f"{url}/api/kernels", token="wrong"))[0] == 403
    assert (await call(f"{url}/api/kernels?token={TOKEN}")) == (200, [])
    assert (await call(f"{url}/api/kernels/nonexistent?token={TOKEN}"))[0] == 404
    assert (await call(f"{url}/api/kernels?token=a-guess"))[0] == 403
    text = log.read_text()
    assert "refused GET /api/kernels from 127.0.0.1: no token" in text
    assert "refused GET /api/kernels from 127.0.0.1: unknown token" in text
    # Tornado logs a 4xx with its URI: the tokens in them are not written.
    assert "GET /api/kernels/nonexistent?token=[redacted]" in text
    assert TOKEN not in text and "a-guess" not in text

    code, specs = await call(f"{url}/api/kernelspecs", token=TOKEN)
    assert code == 200 and specs["default"] == "nbos"
    gpus = {n: s["spec"]["metadata"]["nbos"]["gpus"] for n, s in specs["kernelspecs"].items()}
    assert gpus == {"nbos": 0, "nbos-gpu-1": 1, "nbos-gpu-2": 2}
    assert (await call(f"{url}/api/kernelspecs/nbos-gpu-2", token=TOKEN))[1]["name"] == "nbos-gpu-2"
    assert (await call(f"{url}/api/kernelspecs/nbos-gpu-4", token=TOKEN))[0] == 404

    kernels = f"{url}/api/kernels"
    assert (await call(kernels, "POST", {"name": "python3"}, token=TOKEN))[0] == 404
    too_many = {f"VAR_{i}": "" for i in range(257)}
    for body in (
        b"{",
        b"[1]",
        b'{"name": 5}',
        b'{"env": {"KERNEL_X": 3}}',
        b'{"env": []}',
        b'{"name": "\xff"}',  # not UTF-8
        b'{"env": {"KERNEL_X": "\xed\xa0\x80"}}',  # not UTF-8 (a surrogate)
        json.dumps({"name": "n" * 65}).encode(),
        json.dumps({"env": {"V" * 257: ""}}).encode(),
        json.dumps({"env": too_many}).encode(),
    ):
        code, answer = await call(kernels, "POST", raw=body, token=TOKEN)
        assert code == 400 and answer["message"], (body, answer)
    assert await huge_body_status(url, 2 << 20) == 400
    unknown = f"{kernels}/{uuid.uuid4()}"
    assert (await call(unknown, token=TOKEN))[0] == 404
    assert (await call(unknown, "DELETE", token=TOKEN))[0] == 404
    assert (await call(f"{unknown}/interrupt", "POST", {}, token=TOKEN))[0] == 404
    assert (await call(f"{unknown}/restart", "POST", raw=b"not json", token=TOKEN))[0] == 400
    for token, status in ((None, 401), ("wrong", 403), (TOKEN, 404)):
        with pytest.raises(httpclient.HTTPClientError) as refused:
            await KernelSocket.open(f"{unknown}/channels", token)
        assert refused.value.code == status
    assert (await call(kernels, token=TOKEN)) == (200, [])


async def test_a_notebook_through_jupyter_server_runs_cells_interrupts_restarts_and_deletes(
    gateway: tuple[str, Path], jupyter: str
) -> None:
    gateway_url, log = gateway
    begun = time.monotonic()
    code, model = await call(
        f"{jupyter}/api/kernels", "POST", {"name": "nbos-gpu-1"}, token=JUPYTER_TOKEN
    )
    started_s = time.monotonic() - begun
    assert code == 201, model
    kernel_id = model["id"]
    listed = (await call(f"{gateway_url}/api/kernels", token=TOKEN))[1]
    assert [(k["id"], k["name"], k["nbos"]["gpus"]) for k in listed] == [
        (kernel_id, "nbos-gpu-1", 1)
    ]
    channels = f"{jupyter}/api/kernels/{kernel_id}/channels?token={JUPYTER_TOKEN}"
    ws = await KernelSocket.open(channels.replace("?", f"?session_id={uuid.uuid4()}&"))
    try:
        reply, outputs = await ws.run("import os\nprint(os.environ.get('KERNEL_USERNAME'))")
        # Jupyter Server says KERNEL_USERNAME=alice and signs in with the operator's token,
        # an admin's: the kernel is started for alice (docs/users.md, impersonation).
        assert reply["content"]["status"] == "ok" and stdout(outputs) == "alice\n"

        code_ = "from IPython.display import HTML, display\ndisplay(HTML('<b>nbos</b>'))\n21 * 2"
        reply, outputs = await ws.run(code_)
        assert kinds(outputs) == ["execute_input", "display_data", "execute_result"]
        assert outputs[1]["content"]["data"]["text/html"] == "<b>nbos</b>"
        assert outputs[2]["content"]["data"]["text/plain"] == "42"

        reply, outputs = await ws.run("1 / 0")
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "ZeroDivisionError" and "error" in kinds(outputs)

        reply, outputs = await ws.run("name = input('who? ')\nprint('hello', name)", answer="bob")
        assert reply["content"]["status"] == "ok" and stdout(outputs) == "hello bob\n"

        register = (
            "def on_open(comm, msg):\n"
            "    comm.send({'echo': msg['content']['data']})\n"
            "get_ipython().kernel.comm_manager.register_target('nbos-echo', on_open)"
        )
        assert (await ws.run(register))[0]["content"]["status"] == "ok"
        opened = ws.send(
            "shell", "comm_open", {"comm_id": "c-1", "target_name": "nbos-echo", "data": {"n": 7}}
        )
        with anyio.fail_after(DEADLINE):
            while True:
                msg = await ws.receive()
                if msg["parent_header"].get("msg_id") == opened and msg["msg_type"] == "comm_msg":
                    break
        assert msg["content"]["data"] == {"echo": {"n": 7}}

        sleeping = ws.send(
            "shell",
            "execute_request",
            {"code": "import time\nprint('zz', flush=True)\ntime.sleep(600)"},
        )
        with anyio.fail_after(DEADLINE):
            while not any(
                m["parent_header"].get("msg_id") == sleeping and m["msg_type"] == "stream"
                for m in ws.seen
            ):
                await ws.receive()
        busy = (await call(f"{gateway_url}/api/kernels/{kernel_id}", token=TOKEN))[1]
        assert busy["execution_state"] == "busy" and busy["connections"] == 1
        code, _ = await call(
            f"{jupyter}/api/kernels/{kernel_id}/interrupt", "POST", {}, token=JUPYTER_TOKEN
        )
        assert code == 204
        reply, _ = await ws.finish(sleeping)
        assert reply["content"]["ename"] == "KeyboardInterrupt"

        code, model = await call(
            f"{jupyter}/api/kernels/{kernel_id}/restart", "POST", {}, token=JUPYTER_TOKEN
        )
        assert code == 200 and model["id"] == kernel_id
        reply, outputs = await ws.run("print(name)")
        assert reply["content"]["ename"] == "NameError"
        reply, outputs = await ws.run("print('fresh')")
        assert stdout(outputs) == "fresh\n" and reply["content"]["execution_count"] == 2
    finally:
        ws.close()
    assert (await call(f"{jupyter}/api/kernels/{kernel_id}", "DELETE", token=JUPYTER_TOKEN))[
        0
    ] == 204
    assert (await call(f"{gateway_url}/api/kernels", token=TOKEN)) == (200, [])
    assert f"kernel {kernel_id} (nbos-gpu-1) started for alice" in log.read_text()
    print(f"kernel start through Jupyter Server: {started_s:.2f}s")


async def test_clients_share_a_kernel_and_one_that_vanishes_mid_cell_loses_nothing(
    gateway: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = gateway
    code, model = await call(f"{url}/api/kernels", "POST", {}, token=TOKEN)
    assert code == 201 and model["name"] == "nbos"
    channels = f"{url}/api/kernels/{model['id']}/channels"
    first = await KernelSocket.open(channels, TOKEN, session_id="first")
    second = await KernelSocket.open(channels, TOKEN, session_id="second", v1=True)
    try:
        reply, outputs = await first.run("y = 5\nprint(y)")
        assert stdout(outputs) == "5\n"
        with anyio.fail_after(DEADLINE):
            while not [m for m in second.seen if m["msg_type"] == "stream"]:
                await second.receive()
        assert not [m for m in second.seen if m["channel"] == "shell"]
        reply, outputs = await second.run("print(y + 1)")
        assert stdout(outputs) == "6\n"
        assert (await call(f"{url}/api/kernels/{model['id']}", token=TOKEN))[1]["connections"] == 2

        # The cell goes on once the gateway saw its client go: what follows is held.
        go_on = tmp_path / "go-on"
        cell = (
            f"import os, time\nprint(0, flush=True)\nwhile not os.path.exists({str(go_on)!r}):\n"
            "    time.sleep(0.05)\nfor i in (1, 2, 3):\n    print(i, flush=True)\nz = 7"
        )
        msg_id = first.send("shell", "execute_request", {"code": cell, "silent": False})

        def of_the_cell(m: dict[str, Any]) -> bool:
            return m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == msg_id

        # Once it read the cell's first output (not an earlier cell's), the client goes.
        with anyio.fail_after(DEADLINE):
            while not [m for m in first.seen if of_the_cell(m)]:
                await first.receive()
        first.close()  # gone mid-cell

        async def first_gone() -> bool:
            kernel = await call(f"{url}/api/kernels/{model['id']}", token=TOKEN)
            return bool(kernel[1]["connections"] == 1)

        await poll(first_gone)
        go_on.touch()
        back = await KernelSocket.open(channels, TOKEN, session_id="first")
        back.seen = list(first.seen)
        reply, outputs = await back.finish(msg_id)
        assert reply["content"]["status"] == "ok"
        printed = [m["content"]["text"] for m in back.seen if of_the_cell(m)]
        assert "".join(printed) == "0\n1\n2\n3\n"
        assert stdout((await back.run("print(z)"))[1]) == "7\n"
        back.close()
    finally:
        first.close()
    assert (await call(f"{url}/api/kernels/{model['id']}", "DELETE", token=TOKEN))[0] == 204
    with anyio.fail_after(DEADLINE):
        while True:
            try:
                await second.receive()
            except ConnectionError:
                break
    with pytest.raises(httpclient.HTTPClientError) as refused:
        await KernelSocket.open(channels, TOKEN)
    assert refused.value.code == 404


async def test_a_session_back_before_the_gateway_saw_it_go_replaces_its_old_connection(
    gateway: tuple[str, Path], tmp_path: Path
) -> None:
    """A client back from a lost network opens its session's WebSocket again while the
    gateway still has the old one (it never heard it end), or closes the old one and opens
    a new one at once: the newer connection takes over the session's channels, the reply,
    the prompt for input and the output that followed, each once."""
    url, _ = gateway
    code, model = await call(f"{url}/api/kernels", "POST", {}, token=TOKEN)
    assert code == 201
    kernel_url = f"{url}/api/kernels/{model['id']}"
    channels = f"{kernel_url}/channels"
    go_on = [tmp_path / "go-on-1", tmp_path / "go-on-2"]

    def cell(step: int) -> str:
        return (
            f"import os, time\nprint('before', flush=True)\n"
            f"while not os.path.exists({str(go_on[step])!r}):\n    time.sleep(0.05)\n"
            "print(input('who? '))"
        )

    old = await KernelSocket.open(channels, TOKEN, session_id="roaming")
    sockets = [old]
    try:
        msg_id = old.send("shell", "execute_request", {"code": cell(0), "allow_stdin": True})
        with anyio.fail_after(DEADLINE):
            while not [m for m in old.seen if of_cell(m, msg_id, "stream")]:
                await old.receive()
        # The old socket stays open, silent: the gateway closes it for the new one.
        new = await KernelSocket.open(channels, TOKEN, session_id="roaming")
        sockets.append(new)
        with pytest.raises(ConnectionError), anyio.fail_after(DEADLINE):
            while True:
                await old.receive()
        assert (await call(kernel_url, token=TOKEN))[1]["connections"] == 1
        go_on[0].touch()
        reply, outputs = await new.finish(msg_id, answer="new")
        assert reply["content"]["status"] == "ok"
        assert stdout(outputs) == "new\n"  # "before" went to the old socket, once

        # Closed and opened again at once: the gateway may see the close before or after.
        msg_id = new.send("shell", "execute_request", {"code": cell(1), "allow_stdin": True})
        with anyio.fail_after(DEADLINE):
            while not [m for m in new.seen if of_cell(m, msg_id, "stream")]:
                await new.receive()
        new.close()
        again = await KernelSocket.open(channels, TOKEN, session_id="roaming")
        sockets.append(again)
        go_on[1].touch()
        reply, outputs = await again.finish(msg_id, answer="again")
        assert reply["content"]["status"] == "ok"
        assert stdout(outputs) == "again\n"
        assert stdout((await again.run("print(1 + 1)"))[1]) == "2\n"
        assert (await call(kernel_url, token=TOKEN))[1]["connections"] == 1
    finally:
        for ws in sockets:
            ws.close()
    assert (await call(kernel_url, "DELETE", token=TOKEN))[0] == 204


def of_cell(msg: dict[str, Any], msg_id: str, msg_type: str) -> bool:
    return msg["msg_type"] == msg_type and msg["parent_header"].get("msg_id") == msg_id
