"""The pieces of the control-plane nemeses on real processes and a real tmpfs, without a
cluster: finding a process by its listening port, stopping and continuing it, the CPU
hog's processes and their end, a full tmpfs over a directory and what it leaves behind.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import anyio
import pytest

from nbos.chaos import ChaosKernel, CpuHog, LocalGateway, listening_pids, process_state
from nbos.chaos._full_disk import FILL, _mount_full, _unmount
from nbos.chaos._processes import cont, group_members, stop
from nbos.core.errors import KernelError
from nbos.transport.ports import free_loopback_ports

pytestmark = pytest.mark.anyio

#: CpuHog and the tmpfs helpers use nothing of the kernel.
NO_KERNEL = cast(ChaosKernel, None)

LISTEN = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def listener() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A process listening on a loopback port of its own; killed at the end."""
    [port] = free_loopback_ports(1)
    process = subprocess.Popen(
        [sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    yield port, process
    process.kill()
    process.wait()


async def test_a_gateway_is_found_by_its_port_stopped_and_continued(
    listener: tuple[int, subprocess.Popen[str]],
) -> None:
    port, process = listener
    assert listening_pids(port) == {process.pid}
    gateway = LocalGateway.find(f"127.0.0.1:{port}")
    assert gateway is not None and gateway.gateway_pid() == process.pid

    await stop(process.pid, "the gateway")
    assert process_state(process.pid) == "T"
    cont(process.pid)
    with anyio.fail_after(10):
        while process_state(process.pid) == "T":  # noqa: ASYNC110
            await anyio.sleep(0.02)


def test_a_gateway_in_this_process_or_nowhere_is_not_found() -> None:
    [port] = free_loopback_ports(1)
    assert LocalGateway.find(f"127.0.0.1:{port}") is None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(KernelError, match="runs in this process"):
            LocalGateway(f"127.0.0.1:{port}").gateway_pid()


@pytest.mark.parametrize("stress", [True, False], ids=["stress-ng", "python"])
async def test_the_cpu_hog_loads_every_worker_and_its_heal_ends_them(
    stress: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if stress and shutil.which("stress-ng") is None:
        pytest.skip("stress-ng is not installed")
    if not stress:  # the fallback where stress-ng is missing
        monkeypatch.setattr(shutil, "which", lambda name: None)
    hog = CpuHog(workers=2, hold_s=(1.0, 1.0))
    strike = await hog.strike(NO_KERNEL, random.Random(0))
    group = strike.pids[0]
    try:
        want = 3 if stress else 2  # stress-ng: itself and its 2 workers
        with anyio.fail_after(30):
            while len(group_members(group)) < want:  # noqa: ASYNC110 (other processes: polled)
                await anyio.sleep(0.05)
        assert ("stress-ng" if stress else "python busy loops") in strike.target
    finally:
        await hog.heal(NO_KERNEL, strike)
    assert group_members(group) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_full_tmpfs_over_a_directory_keeps_what_was_written_on_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "gateway"
    state.mkdir()
    (state / "state.json").write_text('{"kernels": ["a"]}')
    (state / "old.json").write_text("removed while full")

    mounted = await _mount_full(state)
    try:
        assert _mounted(state)
        assert (state / "state.json").read_text() == '{"kernels": ["a"]}'  # copied in
        with pytest.raises(OSError, match="No space left"):
            (state / "more.json").write_bytes(b"x" * 65536)
        (state / "more.json").unlink(missing_ok=True)
        # The gateway writes its state while the disk is full: a small write may still fit
        # in the last partial page, as on a real disk; free the fill's tail to be sure.
        os.truncate(state / FILL, max(0, (state / FILL).stat().st_size - 8192))
        (state / "state.json").write_text('{"kernels": ["a", "b"]}')
        (state / "old.json").unlink()
    finally:
        await _unmount(mounted)
    assert not _mounted(state)
    assert sorted(p.name for p in state.iterdir()) == ["state.json"]
    assert (state / "state.json").read_text() == '{"kernels": ["a", "b"]}'


def _mounted(path: Path) -> bool:
    mounts = Path("/proc/mounts").read_text().splitlines()
    return any(line.split()[1] == str(path) for line in mounts)
