"""``nbos gateway`` killed with SIGKILL and started again takes its kernels back.

The gateway runs as a process with its local agents; only the gateway's own PID is
killed. The agents and replicas live on; the gateway started again on the same
settings (the same data dir) finds the agents, adopts the replicas and binds each
kernel's front on its old ports with its old key, so that a Jupyter client
connected before the kill gets the reply to its next cell, which sees the state
of every cell acknowledged before the kill. Replicas that died while the gateway
was down are replaced; those of a kernel left without a majority are restarted in
place from their Raft logs (no replacement can join without a majority). The gateway
has keys, so each kernel's replicas speak CURVE with keys of their kernel's, which must
survive the restart (a replacement after it joins).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from nbos.agent import ProcessIdentity
from nbos.gateway.control_api import KernelInfo, StartKernel
from nbos.transport.keys import generate_keys
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, alive, end_replicas
from tests.gateway._service import ask, run_cell, start_gateway, status_when

# Two gateway starts and a kernel's start, each a Python start: slow on a busy machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(360)]

#: Kill-and-restart rounds; NBOS_DURABLE_ROUNDS for a longer soak.
ROUNDS = int(os.environ.get("NBOS_DURABLE_ROUNDS", "2"))


class Gateway:
    """One ``nbos gateway`` configuration, started (again) as a process."""

    def __init__(self, tmp_path: Path) -> None:
        control, agents = free_loopback_ports(2)
        self.address = f"127.0.0.1:{control}"
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "gateway.log"
        generate_keys(tmp_path / "keys", ["host-1", "host-2", "host-3"])
        self.env = {
            "NBOS_GATEWAY__KEYS": str(tmp_path / "keys"),
            "NBOS_GATEWAY__ADDRESS": self.address,
            "NBOS_GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
            "NBOS_GATEWAY__HEARTBEAT_S": "0.2",
            # A restarted gateway gives the hosts this long (20 s) to find it before their
            # replicas count as lost, and `hurt` has none to spare: a loaded machine may
            # take longer than 5 s to have its agents register again.
            "NBOS_GATEWAY__MISSED_HEARTBEATS": "100",
            "NBOS_CLUSTER__HOSTS": "3",
            "NBOS_CLUSTER__GPUS_PER_HOST": "1",
            "NBOS_CLUSTER__DATA_DIR": str(self.run_dir),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = start_gateway(self.env, self.log)

    def kill(self) -> None:
        """SIGKILL the gateway's own process, nothing else."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def said(self, *words: str) -> list[str]:
        """The lines of the gateway's log with any of ``words`` in them."""
        lines = self.log.read_text().splitlines()
        return [line for line in lines if any(word in line for word in words)]

    def agents(self) -> list[int]:
        """PIDs of the local agents recorded in the data dir that still run."""
        pids = []
        for record in sorted((self.run_dir / "agents").glob("*.pid")):
            identity = msgspec.json.decode(record.read_bytes(), type=ProcessIdentity)
            pidfd = identity.open()
            if pidfd is not None:
                os.close(pidfd)
                pids.append(identity.pid)
        return pids

    def clean_up(self) -> None:
        """End whatever a failed test left: the gateway, its agents, their replicas."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.agents():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for state_dir in (self.run_dir / "agents").glob("host-*"):
            if state_dir.is_dir():
                end_replicas(state_dir)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path)
    yield gw
    gw.clean_up()


def _client(info: KernelInfo) -> BlockingKernelClient:
    client = BlockingKernelClient()
    client.load_connection_info(dict(info.connection))
    client.start_channels()
    return client


def _run(
    client: BlockingKernelClient, code: str, probe: str, timeout: float = DEADLINE
) -> dict[str, Any]:
    """Run ``code``; the shell reply's content, ``probe`` evaluated after it."""
    msg_id = client.execute(code, user_expressions={"probe": probe}, allow_stdin=False)
    while True:
        reply: dict[str, Any] = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]  # type: ignore[no-any-return]


def _probe(content: dict[str, Any]) -> str:
    assert content["status"] == "ok", content
    return str(content["user_expressions"]["probe"]["data"]["text/plain"])


async def test_a_gateway_killed_and_started_again_takes_its_kernels_back(
    gateway: Gateway,
) -> None:
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    started = await ask(gateway.address, StartKernel(gpus=1))
    assert isinstance(started, KernelInfo), started
    # Two more kernels, whose replicas die while the gateway is down: one of three,
    # and two of three.
    hurt = await ask(gateway.address, StartKernel())
    doomed = await ask(gateway.address, StartKernel())
    assert isinstance(hurt, KernelInfo) and isinstance(doomed, KernelInfo)
    assert await run_cell(hurt, "y = 41") == {"status": "ok", "stdout": ""}
    assert await run_cell(doomed, "z = 7") == {"status": "ok", "stdout": ""}
    agents = gateway.agents()
    assert len(agents) == 3
    client = _client(started)
    try:
        content = await anyio.to_thread.run_sync(_run, client, "x = 1", "x")
        assert _probe(content) == "1"
        for round_ in range(1, ROUNDS + 1):
            replicas = [r.pid for r in started.replicas if r.pid is not None]
            gateway.kill()
            # The agents and replicas outlive the gateway.
            assert all(alive(p) for p in agents + replicas)
            if round_ == 1:
                for replica in [hurt.replicas[0], *doomed.replicas[:2]]:
                    assert replica.pid is not None
                    os.kill(replica.pid, signal.SIGKILL)
            gateway.start()
            begun = time.monotonic()
            # The client connected to the killed gateway's front: its next cell goes
            # out at once and is answered by the new front, on the same ports and key
            # (once the gateway is up: a Python start, slow on a busy machine).
            content = await anyio.to_thread.run_sync(_run, client, "x += 1", "x", 3 * DEADLINE)
            took = time.monotonic() - begun
            assert _probe(content) == str(1 + round_)
            print(f"round {round_}: restart to first cell answered {took:.2f} s")

            # The control API answers once every kernel is back, which takes a
            # replica's start for the kernel whose majority is restarted in place.
            listed = await status_when(gateway.address, lambda s: True)
            kernels = {k.kernel_id: k for k in listed.kernels}
            why = gateway.said("lost", "dead", "register")
            assert set(kernels) == {started.kernel_id, hurt.kernel_id, doomed.kernel_id}, why
            kernel = kernels[started.kernel_id]
            assert kernel.kernel_id == started.kernel_id
            assert kernel.connection == started.connection
            assert [(r.node, r.host) for r in kernel.replicas] == [
                (r.node, r.host) for r in started.replicas
            ]
            assert all(r.alive for r in kernel.replicas)
            assert gateway.agents() == agents
            # The GPUs are accounted from the agents' reports: what the killed gateway
            # held is released, and so is the grant of the cell just run (once its reply
            # went out): no GPU stays held.
            await status_when(
                gateway.address,
                lambda s: all(
                    h.state == "up" and h.precommitted + h.committed == 0 for h in s.hosts
                ),
            )
            started = kernel
    finally:
        client.stop_channels()

    # The replica that died is replaced (a new node), the state intact; the kernel that
    # lost its majority has its replicas back in place, its state intact too.
    status = await status_when(
        gateway.address,
        lambda s: sum(r.alive for k in s.kernels for r in k.replicas) == 9,
        # A replacement the second kill cut short is made again (a minute, and a retry).
        timeout=4 * DEADLINE,
    )
    [again] = [k for k in status.kernels if k.kernel_id == hurt.kernel_id]
    assert sorted(r.node for r in again.replicas if r.alive) == [2, 3, 4]
    assert await run_cell(again, "print(y + 1)") == {"status": "ok", "stdout": "42\n"}
    [back] = [k for k in status.kernels if k.kernel_id == doomed.kernel_id]
    before = {(r.node, r.host) for r in doomed.replicas}
    # The survivor was kept, and another came back in place (then the third may have
    # been replaced, had its old port been taken meanwhile).
    assert {r.node: r.pid for r in back.replicas}[3] == doomed.replicas[2].pid
    assert len(before & {(r.node, r.host) for r in back.replicas}) >= 2, back.replicas
    with anyio.fail_after(3 * DEADLINE):
        # Refused at once (QuorumLostError) until a majority answers again.
        while (reply := await run_cell(back, "print(z)"))["status"] != "ok":  # noqa: ASYNC110
            await anyio.sleep(0.5)
    assert reply == {"status": "ok", "stdout": "7\n"}

    replicas = [r.pid for r in started.replicas if r.pid is not None]
    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(timeout=DEADLINE) == 0, gateway.log.read_text()
    assert not [p for p in agents + replicas if alive(p)]
