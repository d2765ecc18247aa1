"""``nbos gateway`` as a process, and its control API, for the gateway tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient

from nbos.core.config import ClusterSettings, GatewaySettings, Settings
from nbos.core.errors import TransportError
from nbos.gateway.auth import client_token
from nbos.gateway.control_api import (
    ClusterStatus,
    ControlReply,
    ControlRequest,
    KernelInfo,
    StatusRequest,
    call,
    sealed,
)
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT


def start_gateway(
    env: Mapping[str, str],
    log: Path,
    where: Callable[[Sequence[str]], list[str]] = list,
    *,
    keep_kernels: bool = False,
) -> subprocess.Popen[bytes]:
    """``python -m nbos gateway`` with ``NBOS_*`` settings ``env``, its output in ``log``.

    Its exit (SIGTERM) shuts its kernels, replicas and local agents down, so that a test
    leaves none, unless ``keep_kernels``: then a gateway with a data dir leaves them
    running for its next start.
    """
    argv = [sys.executable, "-m", "nbos", "--log-level", "INFO", "gateway"]
    if not keep_kernels:
        argv.append("--shutdown-kernels-on-exit")
    with log.open("ab") as out:
        return subprocess.Popen(
            where(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )


def control_gateway(tmp: Path, gpus_per_host: int = 1) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``nbos gateway`` with 3 local agents of ``gpus_per_host`` virtual GPUs, heartbeats a
    loaded machine does not miss and its state in ``tmp/run``: its process, control address
    and log (``tmp/gateway.log``)."""
    control, agents = free_loopback_ports(2)
    env = {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__HEARTBEAT_S": "0.2",
        "NBOS_GATEWAY__MISSED_HEARTBEATS": "25",
        "NBOS_CLUSTER__HOSTS": "3",
        "NBOS_CLUSTER__GPUS_PER_HOST": str(gpus_per_host),
        "NBOS_CLUSTER__DATA_DIR": str(tmp / "run"),
    }
    log = tmp / "gateway.log"
    return start_gateway(env, log), f"127.0.0.1:{control}", log


async def ask(address: str, request: ControlRequest) -> ControlReply:
    return await call(address, request, timeout=DEADLINE)


_replies = msgspec.msgpack.Decoder(ControlReply)


async def ask_raw(
    address: str, body: bytes, timeout: float = DEADLINE, *, token: str | None = None
) -> ControlReply | None:
    """Send the bytes ``body`` as one control request, as any client could, sealed with
    ``token`` (``None``: the gateway's operator token; ``""``: not sealed at all); the
    reply, or ``None`` if none came within ``timeout`` seconds."""
    if token != "":
        body = sealed(body, client_token(address, token))
    socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{address}")
    try:
        await socket.send(body)
        if not await socket.poll(int(timeout * 1000)):
            return None
        reply: ControlReply = _replies.decode(await socket.recv())
        return reply
    finally:
        socket.close()


async def status_when(
    address: str, ready: Callable[[ClusterStatus], bool], timeout: float = 2 * DEADLINE
) -> ClusterStatus:
    """Poll the gateway's status until ``ready`` accepts it (it may not listen yet)."""
    with anyio.fail_after(timeout):
        while True:
            try:
                status = await call(address, StatusRequest(), timeout=5.0)
            except TransportError:  # not up yet: ask again
                status = None
            if isinstance(status, ClusterStatus) and ready(status):
                return status
            await anyio.sleep(0.2)


async def run_cell(info: KernelInfo, code: str, *, shown: bool = False) -> dict[str, Any]:
    """Run ``code`` through a fresh Jupyter client on the kernel's front; stdout and reply
    (``shown``: and the text of each display and display update, such as nbos's line of a
    cell waiting for GPUs)."""
    client = AsyncKernelClient()
    client.load_connection_info(dict(info.connection))
    client.start_channels()
    out: list[str] = []
    displays: list[str] = []

    def output(message: dict[str, Any]) -> None:
        content = message["content"]
        if message["msg_type"] in ("display_data", "update_display_data"):
            displays.append(content["data"].get("text/plain", ""))
        else:
            out.append(content.get("text", ""))

    try:
        reply = await client.execute_interactive(code, timeout=DEADLINE, output_hook=output)
    finally:
        client.stop_channels()
    result = {"status": reply["content"]["status"], "stdout": "".join(out)}
    return {**result, "shown": displays} if shown else result


def local_settings(tmp_path: Path, **gateway: Any) -> Settings:
    """An in-process gateway's settings: 3 local hosts of 2 virtual GPUs, loopback ports of
    its own, heartbeats a loaded machine does not miss, the environment's ``[agent]`` section (no
    pre-started replicas, see ``tests/conftest.py``); ``gateway``: more ``[gateway]`` keys."""
    control, agents = free_loopback_ports(2)
    return Settings(
        agent=Settings.load().agent,
        cluster=ClusterSettings(hosts=3, gpus_per_host=2, data_dir=str(tmp_path / "run")),
        gateway=GatewaySettings(
            address=f"127.0.0.1:{control}",
            agent_address=f"127.0.0.1:{agents}",
            heartbeat_s=0.2,
            missed_heartbeats=25,
            **gateway,
        ),
    )


def autoscaled_settings(tmp_path: Path) -> Settings:
    """:func:`local_settings` with the autoscaler on: 3 to 4 hosts, no cooldowns, a host
    idle for 1 s is drained."""
    return local_settings(
        tmp_path,
        autoscale=True,
        min_hosts=3,
        max_hosts=4,
        autoscale_period_s=0.3,
        scale_out_cooldown_s=0.0,
        scale_in_cooldown_s=0.0,
        idle_grace_s=1.0,
    )


def wipe_raft_dirs(pids: list[int]) -> None:
    """Delete the Raft data directories of the replica processes ``pids`` (their disks
    lost): a kernel whose replicas then all die cannot come back from its disks."""
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        data_dir = Path(argv[argv.index(b"--data-dir") + 1].decode())
        if not data_dir.is_absolute():
            data_dir = Path(os.readlink(f"/proc/{pid}/cwd")) / data_dir
        shutil.rmtree(data_dir)


def local_gateway_env(
    control: int, agents: int, *, heartbeat_s: float = 1.0, missed_heartbeats: int = 5
) -> dict[str, str]:
    """``nbos gateway``'s environment for 3 local agents of 1 GPU each on loopback ports
    ``control`` and ``agents``, with the given heartbeat and silence limit."""
    return {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__HEARTBEAT_S": str(heartbeat_s),
        "NBOS_GATEWAY__MISSED_HEARTBEATS": str(missed_heartbeats),
        "NBOS_CLUSTER__HOSTS": "3",
        "NBOS_CLUSTER__GPUS_PER_HOST": "1",
    }
