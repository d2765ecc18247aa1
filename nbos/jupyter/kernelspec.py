"""The ``nbos`` kernelspec: how Jupyter finds and starts a replicated kernel."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

KERNEL_NAME = "nbos"
PROVISIONER_NAME = "nbos-provisioner"


def kernel_name(gpus: int = 0) -> str:
    """``nbos``, or ``nbos-gpu-N`` for a kernelspec whose cells ask for ``N`` GPUs."""
    return f"{KERNEL_NAME}-gpu-{gpus}" if gpus else KERNEL_NAME


def kernel_json(
    python: str = sys.executable, gpus: int = 0, cluster: str | None = None
) -> dict[str, Any]:
    """The kernelspec's ``kernel.json``. ``gpus`` is the kernel's default GPUs per cell;
    ``cluster``: a cluster file, whose gateway its kernels run on."""
    display = (
        f"nbos (replicated Python, {gpus} GPU per cell)" if gpus else "nbos (replicated Python)"
    )
    argv = [python, "-m", "nbos.jupyter.host", "-f", "{connection_file}", "--gpus", str(gpus)]
    if cluster is not None:
        argv += ["--cluster", cluster]
    return {
        "argv": argv,
        "display_name": display,
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "debugger": False,
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {}},
            "nbos": {"gpus": gpus},
        },
    }


def install(
    *,
    user: bool = False,
    prefix: str | None = None,
    python: str = sys.executable,
    gpus: int = 0,
    cluster: str | None = None,
) -> str:
    """Install the kernelspec :func:`kernel_name` (``gpus``, on the gateway of the cluster
    file ``cluster`` if given); returns the directory it went to."""
    spec = kernel_json(python, gpus, cluster)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.json").write_text(json.dumps(spec, indent=1))
        return str(
            KernelSpecManager().install_kernel_spec(
                tmp, kernel_name=kernel_name(gpus), user=user, prefix=prefix
            )
        )
