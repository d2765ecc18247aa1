"""Compute backends: where replica and agent processes run.

* :class:`LocalProcessBackend` (``local``): virtual hosts, local subprocesses (the default).
* :class:`~nbos.backends.docker.DockerBackend` (``docker``): containers on Docker engines
  (needs the ``docker`` extra).
* :class:`~nbos.backends.ssh.SshBackend` (``ssh``): remote commands over SSH (needs the
  ``ssh`` extra).

All implement :class:`nbos.core.compute_backend.ComputeBackend`. Backends are
registered under the ``nbos.backends`` entry point group; :func:`open_backend`
makes one by name. The Docker and SSH classes are imported on first use so that
the optional extras stay optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbos.backends._common import HOST_ID_ENV, HandleBase, check_start, normalize_exit_status
from nbos.backends._registry import ENTRY_POINT_GROUP, backend_names, open_backend
from nbos.backends.local import LocalProcessBackend, LocalProcessHandle

if TYPE_CHECKING:
    from nbos.backends.docker import DockerBackend, DockerProcessHandle
    from nbos.backends.ssh import SshBackend, SshHost, SshProcessHandle

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOST_ID_ENV",
    "DockerBackend",
    "DockerProcessHandle",
    "HandleBase",
    "LocalProcessBackend",
    "LocalProcessHandle",
    "SshBackend",
    "SshHost",
    "SshProcessHandle",
    "backend_names",
    "check_start",
    "normalize_exit_status",
    "open_backend",
]

_LAZY = {
    "DockerBackend": "nbos.backends.docker",
    "DockerProcessHandle": "nbos.backends.docker",
    "SshBackend": "nbos.backends.ssh",
    "SshHost": "nbos.backends.ssh",
    "SshProcessHandle": "nbos.backends.ssh",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
