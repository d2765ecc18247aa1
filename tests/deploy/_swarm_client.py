"""A Jupyter user of the swarm's gateway, inside a network namespace, driven from stdin.

Run as ``python -m tests.deploy._swarm_client GATEWAY_URL CONTROL TOKEN WORKDIR`` where the
gateway's node address is reachable (nothing outside the namespaces reaches it). It starts
``jupyter server --gateway-url GATEWAY_URL`` on its loopback and speaks to the kernel as a
Jupyter client does, through that server's REST API and kernel WebSocket. Each stdin line
is a JSON command, each answer one JSON line on stdout:

* ``{"op": "start"}``: a new kernel of one GPU (``nbos-gpu-1``) through the server;
  ``{"kernel": ID}`` (its API id);
* ``{"op": "send", "code": C}``: sends the cell to the kernel started last (or to
  ``"kernel": ID``), ``{"msg_id": M}`` at once;
* ``{"op": "finish", "msg_id": M}``: that cell's ``{"status", "stdout", "ename"}``;
* ``{"op": "status"}``: the gateway's ``ClusterStatus`` (its control API at ``CONTROL``),
  or ``{"error": ...}`` while it does not answer;
* ``{"op": "reconnect"}``: new WebSockets (after the gateway restarted), ``{}``;
* ``{"op": "shutdown", "kernel": ID}``: ``DELETE /api/kernels/ID``, ``{"status": S}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from nbos.core.errors import NbosError
from nbos.gateway.control_api import StatusRequest
from nbos.gateway.control_api import call as call_control
from tests._servers._process import stop_process
from tests.gateway._http import KernelSocket, call, start_jupyter_server, stdout, stop

#: How long the server has to stop when this driver is ended: the harness SIGKILLs the
#: driver 10 s after its SIGTERM, which would leave the server behind with parent 1.
_SERVER_STOP_S = 5.0

_CELL_TIMEOUT_S = 300.0


async def main(url: str, control: str, token: str) -> None:
    sockets: dict[str, KernelSocket] = {}  # by kernel, in the order started
    sent: dict[str, str] = {}  # each cell's kernel, by msg_id
    try:
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            command = json.loads(line)
            answer: dict[str, Any] = {}
            kernel = command.get("kernel") or (list(sockets)[-1] if sockets else "")
            if command["op"] == "status":
                try:
                    status = await call_control(control, StatusRequest(), 10.0, token=token)
                except NbosError as exc:  # the gateway is down (killed, restarting)
                    status = {"error": str(exc)}
                answer = msgspec.to_builtins(status)
            elif command["op"] == "start":
                one_gpu = {"name": "nbos-gpu-1"}
                code, model = await call(f"{url}/api/kernels", "POST", one_gpu, "user-token")
                assert code == 201, (code, model)
                sockets[model["id"]] = await _open(url, model["id"])
                answer = {"kernel": model["id"]}
            elif command["op"] == "reconnect":
                for each in list(sockets):
                    sockets[each].close()
                    sockets[each] = await _open(url, each)
            elif command["op"] == "shutdown":
                sockets.pop(kernel).close()
                code, _ = await call(f"{url}/api/kernels/{kernel}", "DELETE", None, "user-token")
                answer = {"status": code}
            elif command["op"] == "send":
                msg_id = sockets[kernel].send("shell", "execute_request", _execute(command))
                sent[msg_id] = kernel
                answer = {"msg_id": msg_id}
            else:
                socket = sockets[sent.pop(command["msg_id"])]
                reply, outputs = await socket.finish(command["msg_id"], timeout=_CELL_TIMEOUT_S)
                content = reply["content"]
                answer = {
                    "status": content["status"],
                    "stdout": stdout(outputs),
                    "ename": content.get("ename", ""),
                }
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        for socket in sockets.values():
            socket.close()


async def _open(url: str, kernel: str) -> KernelSocket:
    return await KernelSocket.open(f"{url}/api/kernels/{kernel}/channels", "user-token")


def _stop_server_on_sigterm(process: subprocess.Popen[bytes]) -> None:
    """End the server, by its pid, when the harness ends this driver.

    A ``finally`` does not run on SIGTERM, and the event loop cannot be unwound from it
    while a thread waits on stdin, so the handler stops the server and exits at once.
    """

    def handler(signum: int, _frame: object) -> None:
        stop_process(process, _SERVER_STOP_S)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _execute(command: dict[str, Any]) -> dict[str, Any]:
    return {"code": command["code"], "silent": False, "allow_stdin": False}


if __name__ == "__main__":
    gateway_url, control, token, workdir = sys.argv[1:]
    # Before the event loop: it waits for the server with a loop of its own.
    Path(workdir).mkdir(parents=True, exist_ok=True)
    # Ended while the server starts: SystemExit unwinds through its start, which stops it.
    signal.signal(signal.SIGTERM, _exit)
    process, url, _ = start_jupyter_server(Path(workdir), gateway_url, token, "user-token")
    _stop_server_on_sigterm(process)
    try:
        anyio.run(main, url, control, token)
    finally:
        stop(process)
