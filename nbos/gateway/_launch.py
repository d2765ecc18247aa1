"""Where a kernel's replicas run: ports, a working directory and connection info on their host.

The gateway's kernel code starts replicas through a
:class:`~nbos.core.replica_launcher.ReplicaLauncher`, one
interface for two places:

* :class:`~nbos.gateway.AgentBackend`: hosts are ``nbos agent`` daemons, on this
  machine or others; ports, directories and connection files are on those hosts;
* :class:`LocalLauncher`: virtual hosts on this machine (the embedded cluster),
  processes started by :class:`~nbos.backends.LocalProcessBackend`, loopback ports.

A replica's argv may hold :data:`~nbos.backends.workdir.WORKDIR_TOKEN` (its working
directory on the host) and :data:`~nbos.backends.workdir.PYTHON_TOKEN` (the host's
interpreter); the launcher fills them in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import anyio

from nbos.backends.local import LocalProcessBackend
from nbos.backends.workdir import (
    expand_argv,
    read_connection_file,
    seed_connection_file,
    workdir_path,
)
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError
from nbos.core.ids import HostId
from nbos.core.wire.agent import ReplicaOwner
from nbos.transport.ports import LOOPBACK, free_loopback_ports

_POLL_S = 0.05


class LocalLauncher:
    """Replicas as local processes of virtual hosts; working directories under ``root``."""

    def __init__(
        self,
        backend: LocalProcessBackend,
        root: Path,
        *,
        virtual_gpus: bool,
        python: str = sys.executable,
    ) -> None:
        self.backend = backend
        self._root = root
        self._virtual = virtual_gpus
        self._python = python
        self._workdirs: WeakKeyDictionary[ProcessHandle, Path] = WeakKeyDictionary()

    def hosts(self) -> Sequence[HostId]:
        return self.backend.hosts()

    def ip(self, host: HostId) -> str:
        return LOOPBACK

    def virtual_gpus(self, host: HostId) -> bool:
        return self._virtual

    async def addresses(self, host: HostId, count: int) -> list[str]:
        ports = await anyio.to_thread.run_sync(free_loopback_ports, count)
        return [f"tcp://{LOOPBACK}:{p}" for p in ports]

    async def start_replica(
        self,
        host: HostId,
        spec: ProcessSpec,
        *,
        workdir: str,
        connection_key: str,
        owner: ReplicaOwner | None = None,
    ) -> ProcessHandle:
        # ``owner`` is for replicas that outlive the gateway; these end with it.
        path = workdir_path(self._root, workdir)
        try:
            await anyio.to_thread.run_sync(
                partial(seed_connection_file, path, LOOPBACK, connection_key, spec.env)
            )
        except OSError as exc:
            raise BackendError(f"cannot prepare {path}: {exc}") from exc
        argv = expand_argv(spec.argv, path, self._python)
        handle = await self.backend.start(host, ProcessSpec(argv, spec.env, spec.label))
        self._workdirs[handle] = path
        return handle

    async def connection_info(self, handle: ProcessHandle, timeout: float) -> Mapping[str, Any]:
        path = self._workdirs.get(handle)
        if path is None:
            raise BackendError(f"{handle!r} is not a replica this launcher started")
        with anyio.move_on_after(timeout):
            while handle.returncode is None:
                info = await anyio.to_thread.run_sync(read_connection_file, path)
                if info is not None:
                    return info
                await anyio.sleep(_POLL_S)
            raise BackendError(f"replica exited with status {handle.returncode} at start")
        raise BackendError(f"replica did not write {path}{os.sep}connection.json in {timeout} s")
