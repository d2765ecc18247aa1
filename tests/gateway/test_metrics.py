"""The gateway's Prometheus endpoint, scraped from a real ``nbos gateway`` after real events."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session
from prometheus_client.parser import text_string_to_metric_families

from nbos.gateway.control_api import KernelInfo, StartKernel
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE
from tests.gateway._service import ask, run_cell, start_gateway, status_when

# One gateway, 4 agents, a kernel and a replacement: slow on a loaded machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    control, agents, metrics = free_loopback_ports(3)
    env = {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        "NBOS_GATEWAY__METRICS_ADDRESS": f"127.0.0.1:{metrics}",
        "NBOS_GATEWAY__HEARTBEAT_S": "0.2",
        "NBOS_GATEWAY__MISSED_HEARTBEATS": "25",
        # A fourth host takes the replica that is killed below.
        "NBOS_CLUSTER__HOSTS": "4",
        "NBOS_CLUSTER__GPUS_PER_HOST": "1",
        "NBOS_CLUSTER__DATA_DIR": str(tmp_path / "run"),
    }
    log = tmp_path / "gateway.log"
    process = start_gateway(env, log)
    yield f"127.0.0.1:{control}", f"http://127.0.0.1:{metrics}", log
    if process.poll() is None:
        # SIGTERM: the gateway stops its agents and replicas (SIGKILL would orphan them).
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(2 * DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scraped_when(url: str, ready: object) -> Samples:
    assert callable(ready)
    with anyio.fail_after(2 * DEADLINE):
        # Polled: the endpoint is all a test sees of these counters.
        while not ready(samples := await anyio.to_thread.run_sync(scrape, url)):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    return samples


async def refused_when(info: KernelInfo, url: str) -> None:
    """A wrongly signed request on the kernel front's shell socket is refused and counted."""
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{info.connection['ip']}:{info.connection['shell_port']}")
    wrong = Session(key=b"not-the-key")
    try:
        await socket.send_multipart(wrong.serialize(wrong.msg("execute_request", {"code": "1"})))
        await scraped_when(url, lambda s: s[("nbos_messages_refused_total", ())] >= 1)
    finally:
        socket.close(0)


async def test_metrics_count_cells_refusals_and_replacements(
    gateway: tuple[str, str, Path],
) -> None:
    address, url, log = gateway
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 4)
    started = await ask(address, StartKernel(gpus=1))
    assert isinstance(started, KernelInfo), started
    assert await run_cell(started, "x = 41") == {"status": "ok", "stdout": ""}

    samples = await anyio.to_thread.run_sync(scrape, url)
    assert samples[("nbos_kernels", ())] == 1
    assert samples[("nbos_replicas_alive", ())] == 3
    assert samples[("nbos_cell_wait_seconds_count", ())] >= 1
    assert samples[("nbos_cell_run_seconds_count", ())] >= 1
    gpus = {labels: v for (name, labels), v in samples.items() if name == "nbos_gpus"}
    # Idle, pre-committed and committed split the 4 GPUs; resident ones (a kernel's tensors
    # left on them, lazy eviction) are idle ones too, so they are counted apart.
    exclusive = sum(v for labels, v in gpus.items() if ("state", "resident") not in labels)
    assert exclusive == 4, gpus
    assert sum(v for labels, v in gpus.items() if ("state", "resident") in labels) <= 4, gpus
    assert samples[("nbos_replicas_moved_total", (("kind", "replacement"),))] == 0

    await refused_when(started, url)

    victim = next(r for r in started.replicas if r.pid is not None)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    moved = ("nbos_replicas_moved_total", (("kind", "replacement"),))
    samples = await scraped_when(
        url, lambda s: s[moved] == 1 and s[("nbos_replicas_alive", ())] == 3
    )
    assert await run_cell(started, "print(x + 1)") == {"status": "ok", "stdout": "42\n"}, (
        log.read_text()[-3000:]
    )
