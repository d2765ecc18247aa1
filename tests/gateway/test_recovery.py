"""A kernel whose replicas all died comes back from their Raft logs on the hosts' disks.

``nbos gateway`` runs as a process with its local agents and a data dir (as in
``test_durable``); a kernel acknowledges ``L = [1, 2, 3]`` and ``L.append(4)``. Then every
replica dies with SIGKILL: alone (the gateway restarts them in place by itself), with
their agents (agents started again on their state dirs), or with the agents and the
gateway (the whole cluster started again). Each time the kernel's next cell sees
``[1, 2, 3, 4]``. With the replicas' Raft directories deleted as well, the kernel cannot
come back: the gateway says so, naming the disks, and serves no empty namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from nbos.gateway.control_api import KernelInfo, KernelList, ListKernels, StartKernel
from tests.agent._daemons import DEADLINE, ROOT, alive
from tests.gateway._service import ask, run_cell, status_when
from tests.gateway.test_durable import Gateway

# Gateway starts, a kernel's start and three replica restarts: slow on a busy machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600), pytest.mark.long]

ACKNOWLEDGED = "[1, 2, 3, 4]\n"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path)
    yield gw
    gw.clean_up()


async def _kernel_with_a_list(gateway: Gateway) -> KernelInfo:
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    kernel = await ask(gateway.address, StartKernel())
    assert isinstance(kernel, KernelInfo), kernel
    assert await run_cell(kernel, "L = [1, 2, 3]") == {"status": "ok", "stdout": ""}
    assert await run_cell(kernel, "L.append(4)") == {"status": "ok", "stdout": ""}
    return kernel


def _kill_replicas(kernel: KernelInfo) -> None:
    pids = [r.pid for r in kernel.replicas]
    assert len(pids) == 3 and all(p is not None for p in pids)
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


async def _gone(pids: list[int]) -> None:
    with anyio.fail_after(DEADLINE):
        while any(alive(p) for p in pids):  # noqa: ASYNC110 (other processes' state)
            await anyio.sleep(0.1)


async def _all_alive(gateway: Gateway, kernel_id: str) -> KernelInfo:
    """The kernel once the gateway lists its 3 replicas alive (they came back)."""
    status = await status_when(
        gateway.address,
        lambda s: any(
            k.kernel_id == kernel_id and sum(r.alive for r in k.replicas) == 3 for k in s.kernels
        ),
        timeout=4 * DEADLINE,
    )
    [kernel] = [k for k in status.kernels if k.kernel_id == kernel_id]
    return kernel


async def _sees_the_list(gateway: Gateway, kernel: KernelInfo) -> None:
    """The kernel comes back on its replicas, in place, and its next cell sees ``L``."""
    back = await _all_alive(gateway, kernel.kernel_id)
    assert back.connection == kernel.connection
    # A majority came back in place (no replacement can join without one); the third may
    # have been replaced: one whose old port was taken meanwhile cannot bind it again.
    before = {(r.node, r.host) for r in kernel.replicas}
    assert len(before & {(r.node, r.host) for r in back.replicas}) >= 2, back.replicas
    with anyio.fail_after(4 * DEADLINE):
        # Refused at once (QuorumLostError) until a majority answers again.
        while (reply := await run_cell(back, "print(L)"))["status"] != "ok":  # noqa: ASYNC110
            await anyio.sleep(0.5)
    assert reply == {"status": "ok", "stdout": ACKNOWLEDGED}
    said = gateway.said("is lost")
    assert not said, said


def _agent_commands(gateway: Gateway) -> list[tuple[list[str], dict[str, str]]]:
    """How each running local agent was started: its argv and environment."""
    commands = []
    for pid in gateway.agents():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        env_items = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
        env = dict(item.decode().split("=", 1) for item in env_items if b"=" in item)
        commands.append(([a.decode() for a in argv], env))
    return commands


def _start_agents(commands: list[tuple[list[str], dict[str, str]]], log: Path) -> list[int]:
    pids = []
    with log.open("ab") as out:
        for argv, env in commands:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
            pids.append(process.pid)
    return pids


async def test_replicas_killed_together_come_back_in_place_by_themselves(
    gateway: Gateway,
) -> None:
    kernel = await _kernel_with_a_list(gateway)
    _kill_replicas(kernel)
    await _sees_the_list(gateway, kernel)


async def test_replicas_and_agents_killed_together_come_back_with_the_agents(
    gateway: Gateway, tmp_path: Path
) -> None:
    kernel = await _kernel_with_a_list(gateway)
    commands = _agent_commands(gateway)
    agents = gateway.agents()
    assert len(commands) == 3
    _kill(agents)
    _kill_replicas(kernel)
    await _gone(agents + [r.pid for r in kernel.replicas if r.pid is not None])
    started = _start_agents(commands, tmp_path / "agents.log")
    try:
        await _sees_the_list(gateway, kernel)
    finally:
        _kill([p for p in started if alive(p)])


async def test_a_whole_cluster_killed_and_started_again_comes_back_from_its_disks(
    gateway: Gateway,
) -> None:
    # Snapshots every other entry: the replicas come back from a snapshot (the namespace
    # image) and the log after it, not from the log alone.
    gateway.env["NBOS_RAFT__SNAPSHOT_EVERY"] = "2"
    kernel = await _kernel_with_a_list(gateway)
    assert all(list(d.glob("snap-*.snap")) for d in _raft_dirs(gateway, kernel))
    agents = gateway.agents()
    gateway.kill()
    _kill(agents)
    _kill_replicas(kernel)
    await _gone(agents + [r.pid for r in kernel.replicas if r.pid is not None])
    gateway.start()
    await _sees_the_list(gateway, kernel)


async def test_a_kernel_whose_hosts_come_back_late_waits_for_them(
    gateway: Gateway, tmp_path: Path
) -> None:
    kernel = await _kernel_with_a_list(gateway)
    commands = _agent_commands(gateway)
    agents = gateway.agents()
    gateway.kill()
    _kill(agents)
    _kill_replicas(kernel)
    await _gone(agents + [r.pid for r in kernel.replicas if r.pid is not None])
    # Started again with one local agent: host-2 and host-3 stay away past their timeout.
    gateway.env["NBOS_CLUSTER__HOSTS"] = "1"
    gateway.start()
    with anyio.fail_after(4 * DEADLINE):
        while not gateway.said(f"kernel {kernel.kernel_id} is not back yet"):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    # Kept, not lost: in the state file for a later start too.
    assert kernel.kernel_id in (gateway.run_dir / "gateway" / "state.json").read_text()
    started = _start_agents(commands[1:], tmp_path / "agents.log")
    try:
        await _sees_the_list(gateway, kernel)
    finally:
        _kill([p for p in started if alive(p)])


async def _said_lost(gateway: Gateway, kernel: KernelInfo) -> None:
    """The gateway said the kernel is lost, naming the disks, and serves no namespace."""
    with anyio.fail_after(4 * DEADLINE):
        while not (said := gateway.said(f"kernel {kernel.kernel_id} is lost")):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    assert "disk" in said[0], said
    # Not served as if healthy: not listed (a client's cell finds no kernel), or with no
    # live replica and its cells refused; never with an empty namespace.
    listed = await ask(gateway.address, ListKernels())
    assert isinstance(listed, KernelList)
    for info in listed.kernels:
        if info.kernel_id == kernel.kernel_id:
            assert not any(r.alive for r in info.replicas), info
            reply = await run_cell(info, "print(L)")
            assert reply["status"] == "error", reply


def _raft_dirs(gateway: Gateway, kernel: KernelInfo) -> list[Path]:
    found = sorted((gateway.run_dir / "agents").glob(f"host-*/work/{kernel.kernel_id}/*/raft"))
    assert len(found) == 3
    return found


async def test_replicas_killed_after_their_disks_were_wiped_leave_their_kernel_lost(
    gateway: Gateway,
) -> None:
    kernel = await _kernel_with_a_list(gateway)
    for raft_dir in _raft_dirs(gateway, kernel):
        shutil.rmtree(raft_dir)  # the replicas run on, on files no longer on the disk
    _kill_replicas(kernel)
    await _said_lost(gateway, kernel)


async def test_a_cluster_whose_disks_are_gone_says_its_kernel_is_lost(gateway: Gateway) -> None:
    kernel = await _kernel_with_a_list(gateway)
    agents = gateway.agents()
    gateway.kill()
    _kill(agents)
    _kill_replicas(kernel)
    await _gone(agents + [r.pid for r in kernel.replicas if r.pid is not None])
    for raft_dir in _raft_dirs(gateway, kernel):
        shutil.rmtree(raft_dir)
    gateway.start()
    await _said_lost(gateway, kernel)
