"""A jupyter_client kernel provisioner that starts a replicated nbos kernel.

Registered as ``nbos-provisioner`` in the ``jupyter_client.kernel_provisioners``
entry point group and named by the ``nbos`` kernelspec, so ``jupyter console
--kernel nbos``, nbclient, papermill and JupyterLab use it unchanged. It runs the
kernel host process (:mod:`nbos.jupyter.host`) like a local kernel; the host
starts the kernel on the gateway and writes the kernel front's connection info,
which the provisioner answers with; the kernel manager then rewrites its
connection file with it. ``poll()`` reports the kernel alive while the host
lives, and the host lives while the kernel does (until the gateway reports it dead).

A restart starts the host again with ``--reuse-connection``: the new kernel's
front takes the old one's ports and key. Signals: ``SIGINT`` becomes an
``interrupt_request`` message to the front (what ``interrupt_mode: message``
sends); ``SIGTERM`` goes to the host, which shuts the kernel down on the gateway;
``SIGKILL`` shuts it down on the gateway first, then kills the host. Other
signals cannot reach a kernel whose replicas may run on other machines:
:class:`~nbos.core.errors.KernelError`.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any, cast

import anyio
import zmq
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from jupyter_client.session import Session
from traitlets import Int

from nbos.core.errors import KernelError, TransportError
from nbos.gateway.control_api import ShutdownKernel, call
from nbos.gateway.requests import kernel_gpus
from nbos.jupyter._front_file import front_info_path

log = logging.getLogger(__name__)

# The host may have to start the per-user gateway first (its agents, then the kernel).
START_TIMEOUT_S = 240.0

_FrontInfo = tuple[dict[str, Any], dict[str, Any]]


class NbosProvisioner(LocalProvisioner):
    """Starts ``python -m nbos.jupyter.host`` and waits for the front's connection info.

    The kernel's GPUs per cell come from the provisioner config (``gpus``), else the
    kernelspec's ``--gpus`` argument, else its metadata ``{"nbos": {"gpus": N}}``.
    """

    gpus = Int(None, allow_none=True, help="The kernel's GPUs per cell.").tag(config=True)

    #: The running kernel: its id and gateway (``None`` before the first start).
    _kernel: tuple[str, str] | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        if self.parent is None:
            raise KernelError("the nbos provisioner runs only under a kernel manager")
        if self._kernel is not None:  # a restart: same ports and key as before
            cmd = [*cmd, "--reuse-connection"]
        await super().launch_kernel(self._with_gpus(cmd), **kwargs)
        info, nbos = await self._front_info(front_info_path(Path(self.parent.connection_file)))
        self._kernel = (str(nbos["kernel_id"]), str(nbos["gateway"]))
        info["key"] = info["key"].encode()
        self.connection_info = cast(KernelConnectionInfo, info)
        return self.connection_info

    async def send_signal(self, signum: int) -> None:
        if signum == signal.SIGINT:
            self._interrupt()
        elif signum == signal.SIGKILL:
            await self._shutdown_on_gateway()
            await super().send_signal(signum)
        elif signum == signal.SIGTERM:
            await super().send_signal(signum)
        else:
            raise KernelError(
                f"signal {signal.Signals(signum).name} cannot reach a replicated nbos kernel "
                "(SIGINT interrupts it, SIGTERM and SIGKILL shut it down)"
            )

    def _interrupt(self) -> None:
        # What the kernel manager sends for interrupt_mode "message", on a socket of our own.
        info = self.connection_info
        session = Session(
            key=cast(bytes, info["key"]), signature_scheme=str(info["signature_scheme"])
        )
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(f"tcp://{info['ip']}:{info['control_port']}")
        try:
            session.send(socket, "interrupt_request", {})
        finally:
            socket.close()

    async def _shutdown_on_gateway(self) -> None:
        if self._kernel is None:
            return
        kernel_id, gateway = self._kernel
        try:
            await call(gateway, ShutdownKernel(kernel_id), timeout=30.0)
        except TransportError as exc:
            log.warning("kernel %s: the gateway did not confirm the shutdown: %s", kernel_id, exc)

    def _with_gpus(self, cmd: list[str]) -> list[str]:
        if self.gpus is not None:
            return [*cmd, "--gpus", str(self.gpus)]  # the host takes the last one given
        if "--gpus" in cmd:
            return cmd
        metadata = self.kernel_spec.metadata if self.kernel_spec is not None else None
        gpus = kernel_gpus(metadata)
        return [*cmd, "--gpus", str(gpus)] if gpus else cmd

    async def _front_info(self, path: Path) -> _FrontInfo:
        with anyio.move_on_after(START_TIMEOUT_S):
            while True:
                status = await self.poll()
                if status is not None:
                    raise KernelError(f"the nbos kernel host exited with status {status}")
                info = _read_front_info(path)
                if info is not None:
                    return info
                await anyio.sleep(0.05)
        await self.kill()
        raise KernelError(f"the nbos kernel host did not start within {START_TIMEOUT_S:.0f}s")

    async def cleanup(self, restart: bool = False) -> None:
        if self.parent is not None:
            front_info_path(Path(self.parent.connection_file)).unlink(missing_ok=True)
        if not restart:
            self._kernel = None
        await super().cleanup(restart=restart)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        # Three replica processes and their Raft group take longer than one kernel.
        return max(recommended, 30.0)


def _read_front_info(path: Path) -> _FrontInfo | None:
    """The front's connection info and the host's ``nbos`` section (kernel id, gateway)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not there yet, or caught mid-write by a non-atomic writer
    if not isinstance(data, dict) or not isinstance(data.get("nbos"), dict):
        return None
    nbos = data.pop("nbos")
    return data, nbos
