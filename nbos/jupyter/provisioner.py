"""A jupyter_client kernel provisioner that starts a replicated nbos kernel.

Registered as ``nbos-provisioner`` in the ``jupyter_client.kernel_provisioners``
entry point group and named by the ``nbos`` kernelspec, so ``jupyter console
--kernel nbos``, nbclient, papermill and JupyterLab use it unchanged. It runs the
kernel host process (:mod:`nbos.jupyter.host`) like a local kernel and answers
with the connection info of the kernel front that the host wrote; the kernel
manager then rewrites its connection file with it. ``poll()``
reports the kernel alive while the host lives, and the host lives while a
quorum of replicas does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import anyio
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from traitlets import Int

from nbos.core.errors import KernelError
from nbos.gateway.requests import kernel_gpus
from nbos.jupyter.host import front_info_path

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


class NbosProvisioner(LocalProvisioner):
    """Starts ``python -m nbos.jupyter.host`` and waits for the front's connection info.

    The kernel's GPUs per cell come from the provisioner config (``gpus``), else the
    kernelspec's ``--gpus`` argument, else its metadata ``{"nbos": {"gpus": N}}``.
    """

    gpus = Int(None, allow_none=True, help="The kernel's GPUs per cell.").tag(config=True)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        await super().launch_kernel(self._with_gpus(cmd), **kwargs)
        if self.parent is None:
            raise KernelError("the nbos provisioner runs only under a kernel manager")
        info = await self._front_info(front_info_path(Path(self.parent.connection_file)))
        info["key"] = info["key"].encode()
        self.connection_info = cast(KernelConnectionInfo, info)
        return self.connection_info

    def _with_gpus(self, cmd: list[str]) -> list[str]:
        if self.gpus is not None:
            return [*cmd, "--gpus", str(self.gpus)]  # the host takes the last one given
        if "--gpus" in cmd:
            return cmd
        metadata = self.kernel_spec.metadata if self.kernel_spec is not None else None
        gpus = kernel_gpus(metadata)
        return [*cmd, "--gpus", str(gpus)] if gpus else cmd

    async def _front_info(self, path: Path) -> dict[str, Any]:
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
        await super().cleanup(restart=restart)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        # Three replica processes and their Raft group take longer than one kernel.
        return max(recommended, 30.0)


def _read_front_info(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not there yet, or caught mid-write by a non-atomic writer
    if not isinstance(data, dict) or "nbos" not in data:
        return None
    return {k: v for k, v in data.items() if k != "nbos"}
