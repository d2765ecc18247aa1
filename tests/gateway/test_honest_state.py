"""Kernel states on real kernels: what the gateway, its APIs and a cell sent say of a kernel
that is degraded, dead, recovering, waiting or busy (issue 27: "a kernel with no live
replica stays listed as idle")."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import KernelConnectionInfo

from nbos.cluster import LocalCluster
from nbos.core.config import GatewaySettings
from nbos.core.executor_chooser import CellPlan, ChoiceRequest
from nbos.gateway import Kernel, KernelState
from nbos.gateway.auth import Authenticator
from nbos.gateway.control_api import KernelInfo, KernelList, ListKernels
from nbos.gateway.http import serve_http
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT
from tests.gateway._http import KernelSocket, call, poll, start_http_gateway
from tests.gateway._service import ask, wipe_raft_dirs
from tests.gateway.test_metrics import scrape

# Kernels started, killed and restarted on a loaded machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
TOKEN = "operator-secret"

#: How long a refused request may take to be answered: far more than an answer given at
#: once takes on a loaded machine, far less than forever (the old answer to a request that
#: no replica was left to serve).
ANSWERED_WITHIN_S = 30.0


def state_of(kernel: Kernel) -> KernelState:
    """The kernel's state now (a call, so that no earlier check of it is taken as still true)."""
    return kernel.state


async def until(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` (state of this process that nothing signals)."""
    with anyio.fail_after(DEADLINE):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def model_of(kernels: str, kernel_id: str) -> dict[str, Any]:
    status, model = await call(f"{kernels}/{kernel_id}", token=TOKEN)
    assert status == 200, model
    return dict(model)


async def shown_as(kernels: str, kernel_id: str, execution_state: str, state: str) -> None:
    """The API's model of the kernel says ``execution_state`` and ``nbos.state`` (the
    activity it reads from IOPub may trail the cell's reply a little)."""

    async def shown() -> bool:
        model = await model_of(kernels, kernel_id)
        return (model["execution_state"], model["nbos"]["state"]) == (execution_state, state)

    await poll(shown)


async def test_degraded_runs_cells_dead_refuses_them_at_once_and_a_restart_recovers(
    tmp_path: Path,
) -> None:
    conf = GatewaySettings(http_address="127.0.0.1:0")
    async with (
        LocalCluster(3, run_dir=tmp_path, replace_dead_replicas=False) as cluster,
        serve_http(conf, cluster.kernel_manager, lambda: 0, Authenticator(TOKEN)) as api,
    ):
        kernels = f"{api.url}/api/kernels"
        kernel_id = (await call(kernels, "POST", {}, token=TOKEN))[1]["id"]
        kernel = cluster.kernel_manager.kernel(kernel_id)
        ws = await KernelSocket.open(f"{kernels}/{kernel_id}/channels", TOKEN)
        try:
            assert (await ws.run("x = 1"))[0]["content"]["status"] == "ok"
            await shown_as(kernels, kernel_id, "idle", "idle")
            first, second, _ = (r.node for r in kernel.replicas)

            # One replica killed, none replacing it: degraded, and cells still run.
            await kernel.kill_replica(first)
            assert state_of(kernel) == "degraded"
            await shown_as(kernels, kernel_id, "idle", "degraded")
            assert (await model_of(kernels, kernel_id))["nbos"]["replicas_alive"] == 2
            reply, outputs = await ws.run("print(x + 1)")
            assert reply["content"]["status"] == "ok", reply
            assert [o["content"]["text"] for o in outputs if o["msg_type"] == "stream"] == ["2\n"]

            # A majority gone, and nothing bringing it back: dead, and a cell says so at once.
            await kernel.kill_replica(second)
            assert state_of(kernel) == "dead"
            await shown_as(kernels, kernel_id, "dead", "dead")
            reply, outputs = await ws.run("print(x)", timeout=ANSWERED_WITHIN_S)
            assert reply["content"]["ename"] == "KernelDeadError", reply
            assert "only replicas" in reply["content"]["evalue"], reply
            assert [o["content"]["ename"] for o in outputs if o["msg_type"] == "error"] == [
                "KernelDeadError"
            ]

            # A replica restarted in place: recovering while it comes back, then degraded.
            async with anyio.create_task_group() as tg:
                tg.start_soon(kernel.restart_replica, second)
                await until(lambda: state_of(kernel) == "recovering")
                model = await model_of(kernels, kernel_id)
                # Recovering: shown busy to Jupyter (not idle, and a culler leaves it).
                assert (model["execution_state"], model["nbos"]["state"]) == (
                    "busy",
                    "recovering",
                )
            assert state_of(kernel) == "degraded"
            reply, outputs = await ws.run("print(x)")
            assert reply["content"]["status"] == "ok", reply
            await shown_as(kernels, kernel_id, "idle", "degraded")
        finally:
            ws.close()


async def test_a_dead_replica_being_replaced_is_recovering_then_the_kernel_is_idle(
    tmp_path: Path,
) -> None:
    async with LocalCluster(3, run_dir=tmp_path, replace_after_s=0.5) as cluster:
        kernel = await cluster.start_kernel()
        assert (await kernel.execute("x = 1")).status == "ok"
        victim = kernel.replicas[0].node
        await kernel.signal_replica(victim, signal.SIGKILL)
        seen: list[str] = []

        def replaced() -> bool:
            if not seen or seen[-1] != state_of(kernel):
                seen.append(state_of(kernel))
            return victim not in {r.node for r in kernel.replicas} and seen[-1] == "idle"

        await until(replaced)
        # Degraded once the front knew (unless the replacement began first), recovering while
        # the new replica joined, idle once it had.
        assert "recovering" in seen, seen
        assert (await kernel.execute("print(x)")).stdout == "1\n"


class HeldChooser:
    """Runs every cell on the lowest live replica, once ``go`` is set; shows why it waits."""

    def __init__(self) -> None:
        self.go = anyio.Event()

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        if request.notify is not None and not self.go.is_set():
            await request.notify("nbos: the cell waits: held by the test")
        await self.go.wait()
        return CellPlan(min(request.alive))

    async def release(self, plan: CellPlan) -> None:
        return None


async def test_a_cell_waiting_to_start_then_running_shows_as_waiting_then_busy(
    tmp_path: Path,
) -> None:
    chooser = HeldChooser()
    async with LocalCluster(3, run_dir=tmp_path, replace_dead_replicas=False) as cluster:
        kernel = await cluster.start_kernel(chooser=chooser)
        assert state_of(kernel) == "idle"
        running, done = tmp_path / "running", tmp_path / "done"

        async def cell() -> None:
            code = (
                f"import os, time\nopen({str(running)!r}, 'w').close()\n"
                f"while not os.path.exists({str(done)!r}):\n    time.sleep(0.05)"
            )
            result = await kernel.execute(code)
            assert result.status == "ok", result.reply

        async with anyio.create_task_group() as tg:
            tg.start_soon(cell)
            await until(lambda: state_of(kernel) == "waiting")
            chooser.go.set()
            await until(running.exists)
            assert state_of(kernel) == "busy"
            done.touch()
        await until(lambda: state_of(kernel) == "idle")


async def test_unanswering_replicas_are_recovering_until_proven_dead(tmp_path: Path) -> None:
    """Suspicion is not proof: replicas the front gave up on whose processes still run (frozen
    here, and never killed for it) may answer again."""
    async with LocalCluster(3, run_dir=tmp_path, replace_dead_replicas=False) as cluster:
        kernel = await cluster.start_kernel()
        frozen = [r.node for r in kernel.replicas][:2]
        for node in frozen:
            await kernel.signal_replica(node, signal.SIGSTOP)
        await until(lambda: len(kernel.front.alive) == 1)
        assert state_of(kernel) == "recovering"
        refused = await kernel.execute("1", timeout=ANSWERED_WITHIN_S)
        assert refused.error is not None and refused.error[0] == "QuorumLostError", refused.reply
        assert "do not answer" in refused.error[1]
        for node in frozen:
            await kernel.kill_replica(node)  # proof: their exits
        assert state_of(kernel) == "dead"


@pytest.fixture
def http_gateway(tmp_path: Path) -> Iterator[tuple[str, str, str, Path]]:
    """``nbos gateway --http`` on default kernel settings (replacement on); its control
    address, API URL, metrics URL and log."""
    control, metrics = free_loopback_ports(2)
    extra = {
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        "NBOS_GATEWAY__METRICS_ADDRESS": f"127.0.0.1:{metrics}",
    }
    process, url, log = start_http_gateway(tmp_path, "t", extra)
    yield f"127.0.0.1:{control}", url, f"http://127.0.0.1:{metrics}", log
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(2 * DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def listed(address: str, kernel_id: str) -> KernelInfo:
    reply = await ask(address, ListKernels())
    assert isinstance(reply, KernelList), reply
    (info,) = [k for k in reply.kernels if k.kernel_id == kernel_id]
    return info


def refused_by_the_front(connection: Mapping[str, Any]) -> dict[str, Any]:
    """A cell and a ``kernel_info_request`` sent to the kernel's front by a Jupyter client:
    each reply, and the cell's IOPub messages (by type), each waited for at most
    :data:`ANSWERED_WITHIN_S` (blocking: run it in a thread)."""
    client = BlockingKernelClient()
    client.load_connection_info(cast("KernelConnectionInfo", dict(connection)))
    client.start_channels()
    try:
        # IOPub is a SUB socket, which misses what is published before it joined: until
        # it hears something, ask for something that publishes (every request's busy/idle).
        deadline = time.monotonic() + DEADLINE
        while True:
            client.kernel_info()
            try:
                client.get_iopub_msg(timeout=1.0)
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "the front's IOPub stayed silent"
        while True:  # drop what the probes left
            try:
                client.get_shell_msg(timeout=0.5)
            except queue.Empty:
                break
        cell = client.execute("print(1)")
        out: dict[str, Any] = {"cell": _reply_to(client, cell)}
        iopub: list[str] = []
        while "idle" not in iopub:
            msg = client.get_iopub_msg(timeout=ANSWERED_WITHIN_S)
            if msg["parent_header"].get("msg_id") == cell:
                kind = msg["msg_type"]
                iopub.append(msg["content"]["execution_state"] if kind == "status" else kind)
        out["iopub"] = iopub
        out["kernel_info"] = _reply_to(client, client.kernel_info())
        return out
    finally:
        client.stop_channels()


def _reply_to(client: BlockingKernelClient, msg_id: str) -> dict[str, Any]:
    end = time.monotonic() + ANSWERED_WITHIN_S
    while True:
        try:
            reply = client.get_shell_msg(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no reply within {ANSWERED_WITHIN_S} s") from None
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"])


async def test_a_kernel_whose_replicas_were_all_killed_is_dead_everywhere_and_says_so_at_once(
    http_gateway: tuple[str, str, str, Path],
) -> None:
    address, url, metrics, log = http_gateway
    kernels = f"{url}/api/kernels"
    status, model = await call(kernels, "POST", {}, token="t")
    assert status == 201, model
    kernel_id = model["nbos"]["kernel_id"]
    info = await listed(address, kernel_id)
    assert info.state == "idle" and model["execution_state"] == "idle"

    # Every replica killed, their disks gone: no majority is left for a replacement to
    # join, and no Raft log to restart one in place from, so nothing brings it back.
    pids = [r.pid for r in info.replicas if r.pid is not None]
    assert len(pids) == 3
    wipe_raft_dirs(pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return (await listed(address, kernel_id)).state == "dead"

    await poll(dead)
    status, model = await call(f"{kernels}/{model['id']}", token="t")
    assert (model["execution_state"], model["nbos"]["state"]) == ("dead", "dead"), model
    assert model["nbos"]["replicas_alive"] == 0
    samples = await anyio.to_thread.run_sync(scrape, metrics)
    assert samples[("nbos_kernels_by_state", (("state", "dead"),))] == 1
    assert samples[("nbos_kernels_by_state", (("state", "idle"),))] == 0
    shown = await anyio.run_process(
        [sys.executable, "-m", "nbos", "status"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NBOS_GATEWAY__ADDRESS": address},
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    (row,) = [line for line in shown.stdout.decode().splitlines() if "0/3" in line]
    kernel, _, user, state, _, _, alive = row.split()[:7]  # KERNEL NBOS-ID USER STATE GPUS AGE
    assert [kernel, user, state, alive] == [kernel_id, "operator", "dead", "0/3"], (
        shown.stdout.decode()
    )

    # A Jupyter client of the front: the cell is refused at once, with the protocol's
    # busy, error output, idle; a kernel_info_request gets an error reply, not silence.
    answers = await anyio.to_thread.run_sync(refused_by_the_front, info.connection)
    cell = answers["cell"]
    assert (cell["status"], cell["ename"]) == ("error", "KernelDeadError"), cell
    assert f"kernel {kernel_id} is dead" in cell["evalue"]
    assert answers["iopub"] == ["busy", "error", "idle"], answers
    assert answers["kernel_info"]["ename"] == "KernelDeadError", (answers, log.read_text()[-3000:])
