"""Clients of the Kernel Gateway API for the tests: REST calls, a kernel's WebSocket,
``nbos gateway --http`` and ``jupyter server --gateway-url`` as processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from tornado import httpclient, websocket

from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT
from tests.gateway._service import start_gateway

V1 = "v1.kernel.websocket.jupyter.org"


async def call(
    url: str,
    method: str = "GET",
    body: Any = None,
    token: str | None = None,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """One REST call; the status and the decoded JSON body (``None`` if empty)."""
    headers = {"Authorization": f"token {token}"} if token else {}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is None and method in ("POST", "PUT"):
        data = b""
    response = await httpclient.AsyncHTTPClient().fetch(
        url,
        method=method,
        body=data,
        headers=headers,
        raise_error=False,
        request_timeout=DEADLINE,
        allow_nonstandard_methods=True,
    )
    if response.code == 599 and response.error is not None and not response.body:
        raise response.error
    return response.code, json.loads(response.body) if response.body else None


async def huge_body_status(url: str, size: int) -> int:
    """The status of a ``POST /api/kernels`` announcing ``size`` bytes, before any is sent."""
    host, port = url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        head = f"POST /api/kernels HTTP/1.1\r\nHost: {host}\r\nContent-Length: {size}\r\n\r\n"
        await stream.send(head.encode())
        with anyio.fail_after(DEADLINE):
            answer = await stream.receive()
    return int(answer.split(b" ", 2)[1])


async def poll(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait until ``check()`` is true (another process's state: nothing signals it here)."""
    with anyio.fail_after(DEADLINE):
        while not await check():  # noqa: ASYNC110
            await anyio.sleep(0.1)


class KernelSocket:
    """A kernel's ``/channels`` WebSocket, as a Jupyter client uses it."""

    def __init__(self, conn: websocket.WebSocketClientConnection, v1: bool) -> None:
        self.conn = conn
        self.v1 = v1
        self.session = Session(key=b"")
        self.seen: list[dict[str, Any]] = []

    @classmethod
    async def open(
        cls, url: str, token: str | None = None, *, session_id: str = "", v1: bool = False
    ) -> KernelSocket:
        ws_url = url.replace("http", "ws", 1) + (f"?session_id={session_id}" if session_id else "")
        headers = {"Authorization": f"token {token}"} if token else {}
        request = httpclient.HTTPRequest(ws_url, headers=headers, request_timeout=DEADLINE)
        conn = await websocket.websocket_connect(request, subprotocols=[V1] if v1 else None)
        assert conn.selected_subprotocol == (V1 if v1 else None)
        return cls(conn, v1)

    def send(self, channel: str, msg_type: str, content: dict[str, Any], **kw: Any) -> str:
        msg = self.session.msg(msg_type, content, **kw)
        if self.v1:
            parts = [
                self.session.pack(msg[k])
                for k in ("header", "parent_header", "metadata", "content")
            ]
            self.conn.write_message(serialize_msg_to_ws_v1(parts, channel), binary=True)
        else:
            msg["channel"] = channel
            self.conn.write_message(json.dumps(msg, default=str))
        return str(msg["header"]["msg_id"])

    async def receive(self, timeout: float = DEADLINE) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            frame = await self.conn.read_message()
        if frame is None:
            raise ConnectionError("the gateway closed the WebSocket")
        if isinstance(frame, bytes):
            channel, parts = deserialize_msg_from_ws_v1(frame)
            keys = ("header", "parent_header", "metadata", "content")
            msg = {k: json.loads(p) for k, p in zip(keys, parts, strict=False)}
            msg["channel"], msg["msg_type"] = channel, msg["header"]["msg_type"]
        else:
            msg = json.loads(frame)
        self.seen.append(msg)
        return msg

    async def run(
        self, code: str, *, answer: str | None = None, timeout: float = DEADLINE, **content: Any
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Run ``code``: its reply and IOPub up to ``idle``; ``input()`` gets ``answer``."""
        msg_id = self.send(
            "shell",
            "execute_request",
            {"code": code, "silent": False, "allow_stdin": answer is not None, **content},
        )
        return await self.finish(msg_id, answer=answer, timeout=timeout)

    async def finish(
        self, msg_id: str, *, answer: str | None = None, timeout: float = DEADLINE
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        reply: dict[str, Any] | None = None
        outputs: list[dict[str, Any]] = []
        idle = False
        with anyio.fail_after(timeout):
            while reply is None or not idle:
                # ``timeout`` bounds the whole cell: a silence longer than a message's
                # usual wait (a lost executor's host suspected, then replaced) is no failure.
                msg = await self.receive(timeout=math.inf)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["channel"] == "stdin" and msg["msg_type"] == "input_request":
                    assert answer is not None
                    self.send("stdin", "input_reply", {"value": answer}, parent=msg)
                elif msg["channel"] == "shell":
                    reply = msg
                elif msg["msg_type"] == "status":
                    idle = msg["content"]["execution_state"] == "idle"
                elif msg["channel"] == "iopub":
                    outputs.append(msg)
        return reply, outputs

    def close(self) -> None:
        self.conn.close()


def stdout(outputs: list[dict[str, Any]]) -> str:
    return "".join(
        o["content"]["text"]
        for o in outputs
        if o["msg_type"] == "stream" and o["content"]["name"] == "stdout"
    )


def kinds(outputs: list[dict[str, Any]]) -> list[str]:
    return [o["msg_type"] for o in outputs]


def start_http_gateway(
    tmp: Path, token: str, extra: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``nbos gateway --http`` with 3 local agents of 2 virtual GPUs; its process, URL and log."""
    control, agents, http = free_loopback_ports(3)
    env = {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__AUTH_TOKEN": token,
        # A loaded test machine must not make the agents look gone.
        "NBOS_GATEWAY__MISSED_HEARTBEATS": "30",
        "NBOS_CLUSTER__HOSTS": "3",
        "NBOS_CLUSTER__GPUS_PER_HOST": "2",
        "NBOS_CLUSTER__DATA_DIR": str(tmp / "run"),
        **(extra or {}),
    }
    log = tmp / "gateway.log"
    process = start_gateway(env, log, lambda argv: [*argv, "--http", f"127.0.0.1:{http}"])
    url = f"http://127.0.0.1:{http}"
    wait_listening(process, f"{url}/api", log)
    return process, url, log


def start_jupyter_server(
    tmp: Path,
    gateway_url: str | None,
    gateway_token: str,
    token: str,
    request_timeout: float = 120.0,
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``jupyter server --gateway-url`` (Jupyter Server's own gateway client); process, URL, log.

    Without ``gateway_url``, a plain Jupyter Server with its own local kernels.
    ``request_timeout``: its ``GatewayClient.request_timeout`` (its own default is 42 s).
    """
    (port,) = free_loopback_ports(1)
    root = tmp / "notebooks"
    root.mkdir(exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "jupyter_server",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        "--allow-root",
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={token}",
    ]
    if gateway_url is not None:
        argv += [
            f"--gateway-url={gateway_url}",
            f"--GatewayClient.auth_token={gateway_token}",
            f"--GatewayClient.request_timeout={request_timeout:g}",
            "--GatewayClient.connect_timeout=60",
        ]
    log = tmp / "jupyter-server.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_DATA_DIR": str(tmp / "data"),
        # Jupyter Server passes KERNEL_* variables on with each kernel request.
        "KERNEL_USERNAME": "alice",
    }
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env
        )
    url = f"http://127.0.0.1:{port}"
    wait_listening(process, f"{url}/api/status?token={token}", log)
    return process, url, log


def wait_listening(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Return once ``url`` answers; else stop ``process`` and raise."""
    try:
        _poll(process, url, log)
    except BaseException:
        stop(process)
        raise


def _poll(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 4 * DEADLINE
    client = httpclient.HTTPClient()
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{url}: the server exited\n{log.read_text()}")
            try:
                client.fetch(url, raise_error=False, request_timeout=5)
                return
            except (OSError, httpclient.HTTPClientError):
                time.sleep(0.2)
        raise TimeoutError(f"{url} did not answer\n{log.read_text()}")
    finally:
        client.close()


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it lingers: the process this test started, by PID."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
