"""A whole host dies mid-cell (its agent and the executor replica on it, SIGKILL: the
gateway hears no exit, only silence) under a client of the HTTP/WebSocket API: the
client gets the lost cell's ``CellLostError`` reply and its ``error`` and ``idle`` on
IOPub, and its next cell runs on the survivors."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from nbos.agent import ProcessIdentity
from tests.agent._daemons import DEADLINE, end_replicas, recorded
from tests.gateway._http import (
    KernelSocket,
    call,
    kinds,
    start_http_gateway,
    start_jupyter_server,
    stdout,
    stop,
)
from tests.gateway.test_durable import end_local_agents

# Each waits out a suspicion and a replacement (about 40 s), or a 70 s silence: CI runs them.
pytestmark = [pytest.mark.anyio, pytest.mark.long, pytest.mark.timeout(600)]

TOKEN = "gateway-secret"
JUPYTER_TOKEN = "jupyter-secret"
#: A silent executor is suspected after the front's 3 missed heartbeats (about 9 s),
#: replaced 30 s later (``replace_suspected_after_s``); a loaded machine adds to both.
LOST_WITHIN_S = 240.0


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    run_dir = tmp_path / "run"
    process, url, log = start_http_gateway(tmp_path, TOKEN, {"NBOS_CLUSTER__HOSTS": "4"})
    try:
        yield url, log, run_dir
    finally:
        stop(process)
        end_local_agents(run_dir)


def kill_host_of(run_dir: Path, replica_pid: int) -> None:
    """SIGKILL the local agent whose replica ``replica_pid`` is, and every replica it runs."""
    agents = run_dir / "agents"
    for state_dir in sorted(p for p in agents.iterdir() if p.is_dir()):
        if any(r.pid == replica_pid for r in recorded(state_dir)):
            record = (agents / f"{state_dir.name}.pid").read_bytes()
            agent = msgspec.json.decode(record, type=ProcessIdentity)
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
            end_replicas(state_dir)
            return
    raise AssertionError(f"no host runs replica {replica_pid}")


@pytest.fixture(params=[False, True], ids=["direct", "jupyter-server"])
def front_door(
    request: pytest.FixtureRequest, gateway: tuple[str, Path, Path], tmp_path: Path
) -> Iterator[tuple[str, str]]:
    """The URL and token a client uses: the gateway's, or a Jupyter Server's in front of it."""
    if not request.param:
        yield gateway[0], TOKEN
        return
    jupyter, url, _ = start_jupyter_server(tmp_path, gateway[0], TOKEN, JUPYTER_TOKEN)
    try:
        yield url, JUPYTER_TOKEN
    finally:
        stop(jupyter)


async def test_a_host_killed_mid_cell_gets_the_websocket_client_its_lost_cell_reply(
    gateway: tuple[str, Path, Path], front_door: tuple[str, str]
) -> None:
    _, log, run_dir = gateway
    url, token = front_door
    code, model = await call(f"{url}/api/kernels", "POST", {"name": "nbos"}, token=token)
    assert code == 201, model
    channels = f"{url}/api/kernels/{model['id']}/channels"
    ws = await KernelSocket.open(channels, token, session_id=str(uuid.uuid4()))
    try:
        reply, _ = await ws.run("x = 1")
        assert reply["content"]["status"] == "ok", reply
        code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
        msg_id = ws.send("shell", "execute_request", {"code": code})
        # The cell runs once its output (its executor's pid) comes back: kill its host then.
        while True:
            msg = await ws.receive()
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                executor = int(msg["content"]["text"])
                break
        kill_host_of(run_dir, executor)
        killed = time.monotonic()
        reply, outputs = await ws.finish(msg_id, timeout=LOST_WITHIN_S)
        print(f"lost cell's reply {time.monotonic() - killed:.1f} s after its host was killed")
        assert reply["content"]["status"] == "error", reply
        assert reply["content"]["ename"] == "CellLostError", reply
        assert kinds(outputs)[-1:] == ["error"], outputs

        reply, outputs = await ws.run("print(x + 1)", timeout=3 * DEADLINE)
        assert reply["content"]["status"] == "ok", reply
        assert stdout(outputs) == "2\n"
        # Settled on proof (the replacement removed the silent member), not on an exit.
        assert "is dead (removed from the kernel)" in log.read_text()
    finally:
        ws.close()


async def test_a_cell_silent_longer_than_a_message_wait_still_gets_its_reply(
    gateway: tuple[str, Path, Path], front_door: tuple[str, str]
) -> None:
    # The silence of a lost cell lasts until its executor is replaced (above): more than a
    # minute where a replica starts slowly (a container). Neither the gateway, nor Jupyter
    # Server in front of it, nor the client's wait for the reply may give up meanwhile.
    url, token = front_door
    code, model = await call(f"{url}/api/kernels", "POST", {"name": "nbos"}, token=token)
    assert code == 201, model
    channels = f"{url}/api/kernels/{model['id']}/channels"
    ws = await KernelSocket.open(channels, token, session_id=str(uuid.uuid4()))
    try:
        code = f"import time; time.sleep({DEADLINE + 10:g}); print('awake')"
        reply, outputs = await ws.run(code, timeout=LOST_WITHIN_S)
        assert reply["content"]["status"] == "ok", reply
        assert stdout(outputs) == "awake\n"
    finally:
        ws.close()
