"""``nbos gateway`` with local agents: kernels through the control API, status, clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from nbos.gateway.control_api import (
    ControlError,
    DigestRequest,
    KernelDigests,
    KernelInfo,
    KernelList,
    RestartReplica,
    ShutdownKernel,
    SignalReplica,
    StartKernel,
)
from tests.agent._daemons import DEADLINE, ROOT, alive
from tests.gateway._service import ask, control_gateway, run_cell, status_when

pytestmark = pytest.mark.anyio


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    process, address, log = control_gateway(tmp_path)
    yield process, address, log
    if process.poll() is None:
        process.kill()
        process.wait()


async def test_kernels_through_the_control_api_then_a_clean_stop_on_sigterm(
    gateway: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, address, log = gateway
    status = await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    assert [(h.host_id, h.gpus, h.idle) for h in status.hosts] == [
        (f"host-{i}", 1, 1) for i in (1, 2, 3)
    ]

    started = await ask(address, StartKernel(gpus=1))
    assert isinstance(started, KernelInfo), started
    assert len({r.host for r in started.replicas}) == 3
    assert await run_cell(started, "x = 40") == {"status": "ok", "stdout": ""}
    assert await run_cell(started, "print(x + 2)") == {"status": "ok", "stdout": "42\n"}

    shown = await anyio.run_process(
        [sys.executable, "-m", "nbos", "status"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NBOS_GATEWAY__ADDRESS": address},
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.decode()
    assert "PRE-COMMITTED" in table and started.kernel_id in table and "host-3" in table

    refused = await ask(address, ShutdownKernel("no-such-kernel"))
    assert isinstance(refused, ControlError) and "no-such-kernel" in refused.message

    # The fault injection of nbos chaos: bad requests refused with their reason.
    digests = await ask(address, DigestRequest(started.kernel_id))
    assert isinstance(digests, KernelDigests) and len(set(digests.digests.values())) == 1
    assert sorted(digests.digests) == [r.node for r in started.replicas]
    for bad, why in [
        (SignalReplica(started.kernel_id, 1, 99999), "signal"),
        (SignalReplica(started.kernel_id, 7, signal.SIGCONT), "no replica 7"),
        (SignalReplica("no-such-kernel", 1, signal.SIGCONT), "no-such-kernel"),
        (RestartReplica(started.kernel_id, 1), "still running"),
    ]:
        answer = await ask(address, bad)
        assert isinstance(answer, ControlError) and why in answer.message, (bad, answer)
    assert await run_cell(started, "print(x)") == {"status": "ok", "stdout": "40\n"}
    second = await ask(address, StartKernel())
    assert isinstance(second, KernelInfo)
    left = await ask(address, ShutdownKernel(started.kernel_id))
    assert isinstance(left, KernelList)
    assert [k.kernel_id for k in left.kernels] == [second.kernel_id]

    pids = [r.pid for r in second.replicas if r.pid is not None]
    assert pids and all(alive(p) for p in pids)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=DEADLINE) == 0, log.read_text()
    assert not [p for p in pids if alive(p)]
