"""A paused gateway blames no host for the silence it caused.

``nbos gateway`` runs as a process with its local agents. It is stopped (SIGSTOP) for
a minute, twelve times the silence after which a host is suspected (a longer fixed
timeout would not do), then continued: the agents spoke all along, unheard. No host
may be suspected, so no replica is reported lost or stopped, and the kernel's next
cell sees the state of the one before the pause. Then the machine is loaded far past
its cores while cells run: no kernel is lost, no acknowledged cell either.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from nbos.gateway.control_api import ClusterStatus, KernelInfo, StartKernel, StatusRequest
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE
from tests.gateway._service import ask, local_gateway_env, run_cell, start_gateway, status_when

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

HEARTBEAT_S = 1.0
MISSED_HEARTBEATS = 5
PAUSE_S = 60.0
#: CPU hogs per core while cells run, and how long (a soak sets it longer).
HOGS_PER_CORE = 4
LOAD_S = float(os.environ.get("NBOS_LOAD_S", "20"))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    control, agents = free_loopback_ports(2)
    address = f"127.0.0.1:{control}"
    log = tmp_path / "gateway.log"
    env = local_gateway_env(
        control, agents, heartbeat_s=HEARTBEAT_S, missed_heartbeats=MISSED_HEARTBEATS
    )
    process = start_gateway(env, log)
    yield address, log, process
    # Without a data dir, a gateway that is told to stop stops its agents and replicas.
    process.send_signal(signal.SIGCONT)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.long
async def test_a_gateway_paused_past_the_silence_limit_suspects_no_host(
    gateway: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    address, log, process = gateway
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    info = await ask(address, StartKernel())
    assert isinstance(info, KernelInfo), info
    assert await run_cell(info, "L = [1]") == {"status": "ok", "stdout": ""}

    process.send_signal(signal.SIGSTOP)
    await anyio.sleep(PAUSE_S)
    process.send_signal(signal.SIGCONT)

    assert await run_cell(info, "L.append(2); print(L)") == {"status": "ok", "stdout": "[1, 2]\n"}
    status = await ask(address, StatusRequest())
    assert isinstance(status, ClusterStatus), status
    said = log.read_text()
    assert [h.state for h in status.hosts] == ["up"] * 3, said
    [kernel] = status.kernels
    assert [(r.node, r.host, r.alive) for r in kernel.replicas] == [
        (r.node, r.host, True) for r in info.replicas
    ], said
    assert "suspected" not in said and "lost" not in said, said


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    """``HOGS_PER_CORE`` busy processes per core for ``LOAD_S`` seconds (ended by PID)."""
    hogs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import time\nt=time.time()+{LOAD_S}\nwhile time.time()<t: pass",
            ]
        )
        for _ in range(HOGS_PER_CORE * (os.cpu_count() or 1))
    ]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


@pytest.mark.long
async def test_a_machine_loaded_far_past_its_cores_loses_no_kernel_and_no_cell(
    gateway: tuple[str, Path, subprocess.Popen[bytes]], cpu_hogs: None
) -> None:
    address, log, _ = gateway
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    info = await ask(address, StartKernel())
    assert isinstance(info, KernelInfo), info
    assert (await run_cell(info, "L = []"))["status"] == "ok"
    appended = 0
    end = anyio.current_time() + LOAD_S
    while anyio.current_time() < end:  # never cancelled mid-cell: each one is counted
        reply = await run_cell(info, f"L.append({appended})")
        assert reply["status"] == "ok", log.read_text()
        appended += 1
    reply = await run_cell(info, "print(L)")
    assert reply == {"status": "ok", "stdout": f"{list(range(appended))}\n"}, log.read_text()
    status = await ask(address, StatusRequest())
    assert isinstance(status, ClusterStatus), status
    [kernel] = status.kernels
    assert sum(r.alive for r in kernel.replicas) >= 2, log.read_text()


def agent_pids(log: Path) -> list[int]:
    """The local agents' pids, as the gateway logged them when it started them."""
    return [
        int(p)
        for p in re.findall(r"agent started \(<LocalProcessHandle \S+ pid=(\d+)", log.read_text())
    ]


@pytest.mark.long
async def test_agents_silent_past_the_limit_are_suspected_but_no_replica_is_stopped(
    gateway: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    """Every agent frozen (as if the gateway were cut off from every host): all hosts are
    suspected, which is no proof; when they speak again the kernel runs on, on the same
    replica processes, with its state."""
    address, log, _ = gateway
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    info = await ask(address, StartKernel())
    assert isinstance(info, KernelInfo), info
    assert await run_cell(info, "L = [1]") == {"status": "ok", "stdout": ""}
    agents = agent_pids(log)
    assert len(agents) == 3, log.read_text()
    for pid in agents:
        os.kill(pid, signal.SIGSTOP)
    try:
        await status_when(address, lambda s: all(h.state == "suspected" for h in s.hosts))
        # Cells go on meanwhile: the replicas themselves are fine.
        assert await run_cell(info, "L.append(2)") == {"status": "ok", "stdout": ""}
    finally:
        for pid in agents:
            os.kill(pid, signal.SIGCONT)
    await status_when(address, lambda s: all(h.state == "up" for h in s.hosts))
    said = log.read_text()
    assert await run_cell(info, "print(L)") == {"status": "ok", "stdout": "[1, 2]\n"}, said
    status = await ask(address, StatusRequest())
    assert isinstance(status, ClusterStatus), status
    [kernel] = status.kernels
    assert [(r.node, r.pid, r.alive) for r in kernel.replicas] == [
        (r.node, r.pid, True) for r in info.replicas
    ], said
    assert all(pid is not None and _running(pid) for pid in (r.pid for r in info.replicas)), said


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
