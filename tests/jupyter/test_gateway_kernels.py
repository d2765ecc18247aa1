"""Kernels of the ``nbos`` kernelspec share the user's gateway; restarts keep the ports;
a dead client's kernel goes away; the gateway goes away once idle.

One per-user gateway for the module, started by the first kernel, with ONE GPU in the
whole cluster (one host, one GPU, one replica per kernel) so that two kernels contend.
Only one kernel can subscribe that GPU (placement's subscription limit): the other
kernel's cell asks for it with ``%%gpus 1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from tests.jupyter._gateway import (
    DEADLINE,
    gateway_kernels,
    kernel_on_gateway,
    process_gone,
    runtime,
    stop_local_gateway,
    wait_until,
)

# The first kernel of a session may start the per-user gateway, its agents cold.
pytestmark = pytest.mark.timeout(300)

GRACE_S = 2.0
# Longer than any gap between two kernels of the module (a restart is one).
IDLE_EXIT_S = 20.0


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("gateway-kernels-runtime")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_RUNTIME_DIR", str(path))
        mp.setenv("NBOS_CLUSTER__HOSTS", "1")
        mp.setenv("NBOS_CLUSTER__GPUS_PER_HOST", "1")
        mp.setenv("NBOS_CLUSTER__REPLICAS_PER_KERNEL", "1")
        mp.setenv("NBOS_GATEWAY__ORPHAN_GRACE_S", str(GRACE_S))
        mp.setenv("NBOS_GATEWAY__LOCAL_IDLE_EXIT_S", str(IDLE_EXIT_S))
        try:
            yield path
        finally:
            stop_local_gateway(path)


def started(kernel_name: str) -> tuple[KernelManager, BlockingKernelClient]:
    km = KernelManager(kernel_name=kernel_name)
    km.start_kernel()
    client = km.client()
    client.start_channels()
    client.wait_for_ready(timeout=DEADLINE)
    return km, client


def stop(km: KernelManager, client: BlockingKernelClient) -> None:
    client.stop_channels()
    km.shutdown_kernel()


def outputs_until_reply(client: BlockingKernelClient, msg_id: str) -> tuple[list[str], str]:
    """The stream text of request ``msg_id`` and its reply's status."""
    texts: list[str] = []
    reply = client.get_shell_msg(timeout=DEADLINE)
    assert reply["parent_header"]["msg_id"] == msg_id
    while True:
        msg = client.get_iopub_msg(timeout=DEADLINE)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return texts, reply["content"]["status"]


def first_output(client: BlockingKernelClient, msg_id: str) -> str:
    """The text of the cell's first output: a stream, or nbos's wait status display."""
    while True:
        msg = client.get_iopub_msg(timeout=DEADLINE)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            return str(msg["content"]["text"])
        if msg["msg_type"] == "display_data" and "nbos" in msg["content"]["metadata"]:
            return str(msg["content"]["data"]["text/plain"])


def test_two_kernels_start_one_gateway_and_wait_for_its_one_gpu(
    runtime_dir: Path, tmp_path: Path
) -> None:
    # Both start at once: the runtime file's lock lets one of them start the gateway.
    kernels: dict[str, tuple[KernelManager, BlockingKernelClient]] = {}
    threads = [
        threading.Thread(target=lambda n=name: kernels.update({n: started(n)}))  # type: ignore[misc]
        for name in ("nbos-gpu-1", "nbos")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(kernels) == 2
    (km_a, a), (km_b, b) = kernels["nbos-gpu-1"], kernels["nbos"]
    try:
        announced = runtime(runtime_dir).read()
        assert announced is not None
        assert kernel_on_gateway(km_a)[1] == kernel_on_gateway(km_b)[1] == announced.address
        assert set(gateway_kernels(announced.address)) == {
            kernel_on_gateway(km_a)[0],
            kernel_on_gateway(km_b)[0],
        }

        release = tmp_path / "release"
        hold = (
            "import os, time\nprint('holding', flush=True)\n"
            f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.05)"
        )
        held = a.execute(hold)
        assert first_output(a, held) == "holding\n"
        # The kernelspec's GPU per cell went to the gateway: a's plain cell holds the GPU.
        waiting = b.execute("%%gpus 1\nprint('ran')")
        assert first_output(b, waiting).startswith("nbos: the cell waits")
        assert b.shell_channel.msg_ready() is False, "the second cell ran beside the first"
        release.touch()
        assert outputs_until_reply(a, held)[1] == "ok"
        texts, status = outputs_until_reply(b, waiting)
        assert status == "ok" and texts[-1] == "ran\n"
    finally:
        for km, client in kernels.values():
            stop(km, client)


def test_restart_keeps_an_open_client_working(runtime_dir: Path) -> None:
    km, client = started("nbos")
    try:
        assert client.execute_interactive("x = 1", timeout=DEADLINE)["content"]["status"] == "ok"
        before = km.get_connection_info()
        km.restart_kernel()
        after = km.get_connection_info()
        ports = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port", "key")
        assert {k: after[k] for k in ports} == {k: before[k] for k in ports}
        out: list[str] = []
        reply = client.execute_interactive(
            "print('x' in globals())",
            timeout=DEADLINE,
            output_hook=lambda m: out.append(m["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok"
        assert "".join(out) == "False\n", "a restart gives a fresh namespace"
    finally:
        stop(km, client)


_CLIENT = """
import sys, time
from jupyter_client.manager import KernelManager

km = KernelManager(kernel_name="nbos")
km.start_kernel()
kernel_id, gateway = km.provisioner._kernel
print(kernel_id, gateway, km.provisioner.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_clients_kernel_goes_away_after_the_grace_period(runtime_dir: Path) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    try:
        assert client.stdout is not None
        kernel_id, gateway, host_pid = client.stdout.readline().split()
        replicas = gateway_kernels(gateway)[kernel_id].replicas
        pids = [r.pid for r in replicas if r.pid is not None]
        assert pids and all(not process_gone(p) for p in pids)
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        assert wait_until(lambda: kernel_id not in gateway_kernels(gateway)), "kernel lives on"
        assert wait_until(lambda: all(process_gone(p) for p in [*pids, int(host_pid)]))
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


@pytest.mark.long
def test_the_gateway_exits_once_it_had_no_kernel_for_its_idle_time(runtime_dir: Path) -> None:
    announced = runtime(runtime_dir).read()
    assert announced is not None
    assert wait_until(lambda: process_gone(announced.pid), IDLE_EXIT_S + DEADLINE)
    assert runtime(runtime_dir).read() is None
