"""Jupyter integration: the ``nbos`` kernelspec, its kernel provisioner and the kernel host."""

from nbos.jupyter.kernelspec import KERNEL_NAME, PROVISIONER_NAME, install, kernel_json
from nbos.jupyter.provisioner import NbosProvisioner

__all__ = ["KERNEL_NAME", "PROVISIONER_NAME", "NbosProvisioner", "install", "kernel_json"]
