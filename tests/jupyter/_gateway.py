"""The per-user gateway that the ``nbos`` kernelspec starts, seen from the tests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
from jupyter_client.manager import KernelManager

from nbos.gateway.control_api import KernelInfo, KernelList, ListKernels, call
from nbos.gateway.runtime import RuntimeFile
from nbos.jupyter.local_gateway import RUNTIME_NAME
from nbos.jupyter.provisioner import NbosProvisioner

DEADLINE = 60.0


def wait_until(predicate: Callable[[], object], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def process_gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie nobody reaped yet counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def runtime(runtime_dir: Path) -> RuntimeFile:
    return RuntimeFile(runtime_dir / RUNTIME_NAME)


def stop_local_gateway(runtime_dir: Path) -> None:
    """End the per-user gateway the tests' kernels started in ``runtime_dir``, if any."""
    found = runtime(runtime_dir).read()
    if found is None or process_gone(found.pid):
        return
    os.kill(found.pid, signal.SIGTERM)
    if not wait_until(lambda: process_gone(found.pid), 30.0):
        os.kill(found.pid, signal.SIGKILL)


def kernel_on_gateway(km: KernelManager) -> tuple[str, str]:
    """The kernel id and gateway address of ``km``'s kernel."""
    provisioner = km.provisioner
    assert isinstance(provisioner, NbosProvisioner) and provisioner._kernel is not None
    return provisioner._kernel


def gateway_kernels(address: str) -> dict[str, KernelInfo]:
    reply = anyio.run(call, address, ListKernels(), DEADLINE)
    assert isinstance(reply, KernelList), reply
    return {k.kernel_id: k for k in reply.kernels}


def replica_pids(km: KernelManager, *, alive_only: bool = True) -> list[int]:
    """The replica processes of ``km``'s kernel, as its gateway reports them."""
    kernel_id, address = kernel_on_gateway(km)
    replicas = gateway_kernels(address)[kernel_id].replicas
    return [r.pid for r in replicas if r.pid is not None and (r.alive or not alive_only)]
