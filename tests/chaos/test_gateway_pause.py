"""A paused gateway blames no host for the silence it caused.

``nbos gateway`` runs as a process with its local agents. It is stopped (SIGSTOP) for
more than twice the time after which a silent host is suspected, then continued: the
agents spoke all along, unheard. No host may be suspected, so no replica is reported
lost or stopped, and the kernel's next cell sees the state of the one before the pause.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from nbos.gateway.control_api import ClusterStatus, KernelInfo, StartKernel, StatusRequest
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE
from tests.gateway._service import ask, run_cell, start_gateway, status_when

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

HEARTBEAT_S = 1.0
MISSED_HEARTBEATS = 5
PAUSE_S = 2.5 * HEARTBEAT_S * MISSED_HEARTBEATS


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    control, agents = free_loopback_ports(2)
    address = f"127.0.0.1:{control}"
    log = tmp_path / "gateway.log"
    env = {
        "NBOS_GATEWAY__ADDRESS": address,
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__HEARTBEAT_S": str(HEARTBEAT_S),
        "NBOS_GATEWAY__MISSED_HEARTBEATS": str(MISSED_HEARTBEATS),
        "NBOS_CLUSTER__HOSTS": "3",
        "NBOS_CLUSTER__GPUS_PER_HOST": "1",
    }
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
