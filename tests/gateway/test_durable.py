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

A gateway with a data dir that is stopped (SIGTERM) or dies of an exception stops
nothing either and leaves its state file as it was: its next start takes the kernels
back. Only ``ShutdownCluster`` shuts them down.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from nbos.agent import ProcessIdentity
from nbos.core.errors import KernelError
from nbos.gateway.control_api import (
    ControlError,
    KernelInfo,
    KernelList,
    ListKernels,
    ShutdownCluster,
    StartKernel,
)
from nbos.gateway.service import GatewayService
from nbos.transport.keys import generate_keys
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, alive, end_replicas
from tests.gateway._full_disk import fill, free_pages, pages_for, small_tmpfs
from tests.gateway._http import KernelSocket, call, stdout
from tests.gateway._service import ask, local_settings, run_cell, start_gateway, status_when

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
        self.process = start_gateway(self.env, self.log, keep_kernels=True)

    def state(self) -> bytes:
        return (self.run_dir / "gateway" / "state.json").read_bytes()

    def wait_exit(self) -> None:
        """Until the gateway process ended by itself; it must end well."""
        assert self.process is not None
        assert self.process.wait(timeout=2 * DEADLINE) == 0, self.log.read_text()[-5000:]

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
        return local_agents(self.run_dir)

    def clean_up(self) -> None:
        """End whatever a failed test left: the gateway, its agents, their replicas."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        end_local_agents(self.run_dir)


def local_agents(run_dir: Path) -> list[int]:
    """PIDs of the local agents recorded in ``run_dir`` (a gateway's) that still run."""
    pids = []
    for record in sorted((run_dir / "agents").glob("*.pid")):
        identity = msgspec.json.decode(record.read_bytes(), type=ProcessIdentity)
        pidfd = identity.open()
        if pidfd is not None:
            os.close(pidfd)
            pids.append(identity.pid)
    return pids


def end_local_agents(run_dir: Path) -> None:
    """SIGKILL the local agents of a gateway's ``run_dir`` and their replicas."""
    for pid in local_agents(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for state_dir in (run_dir / "agents").glob("host-*"):
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
    # A new node, past any the second kill's cut-short replacement had added.
    *kept, new = sorted(r.node for r in again.replicas if r.alive)
    assert kept == [2, 3] and new >= 4, again.replicas
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

    # Shutting the cluster down is explicit: every kernel, then the gateway and its agents.
    replicas = [r.pid for r in [*started.replicas, *again.replicas] if r.pid is not None]
    assert await ask(gateway.address, ShutdownCluster()) == KernelList([])
    gateway.wait_exit()
    assert not [p for p in agents + replicas if alive(p)]
    assert b'"kernels":[]' in gateway.state()


@pytest.mark.long
async def test_a_gateway_stopped_by_sigterm_leaves_its_kernels_running_for_its_next_start(
    gateway: Gateway,
) -> None:
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    started = await ask(gateway.address, StartKernel())
    assert isinstance(started, KernelInfo), started
    assert await run_cell(started, "x = 41") == {"status": "ok", "stdout": ""}
    replicas = [r.pid for r in started.replicas if r.pid is not None]
    agents = gateway.agents()
    assert len(replicas) == 3 and len(agents) == 3
    saved = gateway.state()
    assert started.kernel_id.encode() in saved

    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGTERM)
    gateway.wait_exit()
    # Nothing was stopped, and the state file was not written on the way out.
    assert [p for p in agents + replicas if not alive(p)] == []
    assert gateway.state() == saved

    gateway.start()
    status = await status_when(
        gateway.address,
        lambda s: any(k.kernel_id == started.kernel_id for k in s.kernels),
    )
    [kernel] = status.kernels
    assert kernel.connection == started.connection
    assert [r.pid for r in kernel.replicas] == replicas
    assert await run_cell(kernel, "print(x)") == {"status": "ok", "stdout": "41\n"}
    assert gateway.agents() == agents

    assert await ask(gateway.address, ShutdownCluster()) == KernelList([])
    gateway.wait_exit()
    assert not [p for p in agents + replicas if alive(p)]


class _Bug(Exception):
    """What no part of the gateway expects."""


async def test_a_gateway_that_dies_of_an_exception_leaves_its_kernels_and_its_state(
    tmp_path: Path,
) -> None:
    settings = local_settings(tmp_path)
    run_dir = tmp_path / "run"
    state = run_dir / "gateway" / "state.json"
    died = False
    try:
        try:
            async with GatewayService.serve(settings) as service:
                kernel = await service.kernel_manager.start_kernel()
                kernel_id = kernel.kernel_id
                assert (await kernel.execute("x = 41")).status == "ok"
                replicas = [r.pid for r in kernel.replicas if r.pid is not None]
                saved = state.read_bytes()
                assert kernel.kernel_id.encode() in saved
                raise _Bug("a bug in the gateway")
        except* _Bug:
            died = True
        assert died
        assert state.read_bytes() == saved
        # The gateway let go of the kernel: it closed its own client of it (left to the
        # garbage collector, that client hung the thread that collected it).
        with pytest.raises(KernelError, match="no longer run by this gateway"):
            await kernel.execute("x")
        del kernel
        collector = threading.Thread(target=gc.collect, daemon=True)
        collector.start()
        collector.join(timeout=DEADLINE)
        assert not collector.is_alive(), "the garbage collector hung"
        agents = local_agents(run_dir)
        assert len(agents) == 3
        assert [p for p in agents + replicas if not alive(p)] == []

        async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
            again = service.kernel_manager.kernel(kernel_id)
            result = await again.execute("print(x)")
            assert result.status == "ok" and result.stdout == "41\n"
        assert not [p for p in agents + replicas if alive(p)]
    finally:
        end_local_agents(run_dir)


# --- acknowledged only once on disk ------------------------------------------------


def _started(gateway: Gateway, but: str) -> list[int]:
    """PIDs of the replicas the gateway's log says it started, but those of kernel ``but``."""
    found = re.findall(r"started '(\w+)-replica-\d+' on \S+ as \w+ \(pid (\d+)\)", _log(gateway))
    return [int(pid) for label, pid in found if not but.startswith(label)]


def _log(gateway: Gateway) -> str:
    return gateway.log.read_text()


async def _ended(pids: list[int]) -> None:
    with anyio.fail_after(DEADLINE):
        while any(alive(p) for p in pids):  # noqa: ASYNC110 (other processes' state)
            await anyio.sleep(0.1)


def _state(gateway: Gateway) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((gateway.run_dir / "gateway" / "state.json").read_text())
    return data


async def test_a_start_on_a_full_disk_fails_and_leaves_nothing_running(
    gateway: Gateway,
) -> None:
    # The gateway's own directory on a small file system of its own: the agents' state
    # (replica records, Raft logs) is elsewhere, as on a gateway machine of its own.
    (http,) = free_loopback_ports(1)
    gateway.env |= {
        "NBOS_GATEWAY__HTTP_ADDRESS": f"127.0.0.1:{http}",
        "NBOS_GATEWAY__AUTH_TOKEN": "secret",
    }
    with small_tmpfs(gateway.run_dir / "gateway"):
        gateway.start()
        await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
        first = await ask(gateway.address, StartKernel())
        assert isinstance(first, KernelInfo), first
        assert await run_cell(first, "x = 41") == {"status": "ok", "stdout": ""}
        recorded_first = json.dumps(_state(gateway)["kernels"])

        # A full disk: the start is refused before any of its replicas starts.
        filler = fill(gateway.run_dir / "gateway")
        refused = await ask(gateway.address, StartKernel())
        assert isinstance(refused, ControlError), refused
        assert refused.kind == "failed" and "ENOSPC" in refused.message, refused
        # The Kernel Gateway API's answer: 507 Insufficient Storage, and why.
        url = f"http://127.0.0.1:{http}/api/kernels"
        code, body = await call(url, "POST", {"name": "nbos"}, token="secret")
        assert code == 507 and "ENOSPC" in body["message"], (code, body)
        assert _started(gateway, first.kernel_id) == []

        # Room for the record of the start, not for the kernel's: its replicas started,
        # and are stopped before the answer.
        size = (gateway.run_dir / "gateway" / "state.json").stat().st_size
        room = pages_for(size + 512)
        assert pages_for(2 * size - 512) > room, size  # a second kernel's record is larger
        free_pages(filler, room)
        refused = await ask(gateway.address, StartKernel())
        assert isinstance(refused, ControlError), refused
        assert "ENOSPC" in refused.message, refused
        started = _started(gateway, first.kernel_id)
        assert len(started) == 3, _log(gateway)
        await _ended(started)

        # The kernel that was there runs on, its record as it was.
        assert await run_cell(first, "print(x + 1)") == {"status": "ok", "stdout": "42\n"}
        listed = await ask(gateway.address, ListKernels())
        assert isinstance(listed, KernelList)
        assert [k.kernel_id for k in listed.kernels] == [first.kernel_id]
        assert json.dumps(_state(gateway)["kernels"]) == recorded_first

        # Space again: a start succeeds and is on disk when it is answered.
        filler.unlink()
        again = await ask(gateway.address, StartKernel())
        assert isinstance(again, KernelInfo), again
        state = _state(gateway)
        assert {k["kernel_id"] for k in state["kernels"]} == {first.kernel_id, again.kernel_id}
        assert state["starting"] == []
        gateway.kill()
        gateway.clean_up()


async def test_a_restart_stops_the_replicas_its_record_dropped_or_never_acknowledged(
    gateway: Gateway,
) -> None:
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    unacknowledged = await ask(gateway.address, StartKernel())
    dropped = await ask(gateway.address, StartKernel())
    other = await ask(gateway.address, StartKernel())
    assert isinstance(unacknowledged, KernelInfo) and isinstance(other, KernelInfo)
    assert isinstance(dropped, KernelInfo)
    never = [r.pid for r in unacknowledged.replicas if r.pid is not None]
    gone = [r.pid for r in dropped.replicas if r.pid is not None]
    kept = [r.pid for r in other.replicas if r.pid is not None]
    assert len(never) == len(gone) == len(kept) == 3

    # A gateway killed between a start's two writes: the file names the start, not the
    # kernel (the record of a crash mid-start).
    gateway.kill()
    path = gateway.run_dir / "gateway" / "state.json"
    state = _state(gateway)
    [record] = [k for k in state["kernels"] if k["kernel_id"] == unacknowledged.kernel_id]
    state["kernels"].remove(record)
    hosts = [r["host"] for r in record["replicas"]]
    state["starting"] = [{"kernel_id": unacknowledged.kernel_id, "hosts": hosts}]
    # And one whose shutdown was recorded, its replicas not stopped yet at the kill.
    state["kernels"] = [k for k in state["kernels"] if k["kernel_id"] != dropped.kernel_id]
    path.write_text(json.dumps(state))
    gateway.start()
    await _ended(never + gone)
    assert gateway.said("never acknowledged") and gateway.said("its record dropped")
    listed = await ask(gateway.address, ListKernels())
    assert isinstance(listed, KernelList)
    assert [k.kernel_id for k in listed.kernels] == [other.kernel_id]
    assert all(alive(p) for p in kept)


@pytest.mark.long
async def test_a_gateway_that_lost_its_state_or_has_an_older_copy_adopts_what_it_finds(
    gateway: Gateway,
) -> None:
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    orphan = await ask(gateway.address, StartKernel(gpus=1))
    assert isinstance(orphan, KernelInfo), orphan
    assert await run_cell(orphan, "y = 41") == {"status": "ok", "stdout": ""}
    kept = [r.pid for r in orphan.replicas if r.pid is not None]
    assert len(kept) == 3

    # The state file is gone (deleted, a new disk): the replicas are adopted, not stopped.
    gateway.kill()
    (gateway.run_dir / "gateway" / "state.json").unlink()
    gateway.start()
    # It answers once it settled what it found.
    adopted = await status_when(gateway.address, lambda s: True)
    assert [k.kernel_id for k in adopted.kernels] == [orphan.kernel_id], gateway.said("replica")
    [kernel] = adopted.kernels
    assert kernel.connection["key"] != orphan.connection["key"]  # a new front: clients reconnect
    # Its user came back with it: each replica's agent kept it (ReplicaOwner.user).
    assert kernel.owner == orphan.owner == "operator"
    assert gateway.said("adopted")
    assert sorted(r.pid for r in kernel.replicas if r.pid is not None) == sorted(kept)
    assert all(alive(p) for p in kept)
    assert await run_cell(kernel, "print(y + 1)") == {"status": "ok", "stdout": "42\n"}
    # And on disk, in the new state (the gateway answers once it wrote it).
    [record] = _state(gateway)["kernels"]
    assert (record["kernel_id"], record["gpus"]) == (orphan.kernel_id, 1)

    # An older copy of the state file put back (a backup): the kernel started after it
    # was written is not dropped from it, only unknown to it: adopted too.
    path = gateway.run_dir / "gateway" / "state.json"
    copy = path.read_bytes()
    later = await ask(gateway.address, StartKernel())
    assert isinstance(later, KernelInfo), later
    assert await run_cell(later, "z = 1") == {"status": "ok", "stdout": ""}
    gateway.kill()
    path.write_bytes(copy)
    gateway.start()
    status = await status_when(gateway.address, lambda s: True)
    assert sorted(k.kernel_id for k in status.kernels) == sorted(
        [orphan.kernel_id, later.kernel_id]
    ), gateway.said("replica")
    [again] = [k for k in status.kernels if k.kernel_id == later.kernel_id]
    assert await run_cell(again, "print(z + 1)") == {"status": "ok", "stdout": "2\n"}


async def test_a_restarted_gateways_http_api_serves_the_kernels_it_took_back(
    gateway: Gateway,
) -> None:
    """JupyterLab (through Jupyter Server's ``--gateway-url``) holds a kernel by its API
    id: after a SIGKILL and a new start (a Swarm restart), that id still leads to the
    kernel and its namespace."""
    (http,) = free_loopback_ports(1)
    url = f"http://127.0.0.1:{http}/api/kernels"
    gateway.env |= {
        "NBOS_GATEWAY__HTTP_ADDRESS": f"127.0.0.1:{http}",
        "NBOS_GATEWAY__AUTH_TOKEN": "secret",
    }
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    code, model = await call(url, "POST", {"name": "nbos-gpu-1"}, token="secret")
    assert code == 201, (code, model)
    socket = await KernelSocket.open(f"{url}/{model['id']}/channels", "secret")
    reply, _ = await socket.run("x = 41")
    assert reply["content"]["status"] == "ok", reply
    socket.close()

    gateway.kill()
    gateway.start()
    await status_when(gateway.address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    code, again = await call(f"{url}/{model['id']}", token="secret")
    assert code == 200, (code, again)
    assert (again["id"], again["name"]) == (model["id"], "nbos-gpu-1")
    socket = await KernelSocket.open(f"{url}/{model['id']}/channels", "secret")
    reply, outputs = await socket.run("print(x + 1)")
    socket.close()
    assert reply["content"]["status"] == "ok", reply
    assert stdout(outputs) == "42\n"
    gateway.kill()
