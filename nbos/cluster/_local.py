"""The embedded local cluster: virtual hosts on this machine, replicated kernels on them.

::

    async with nbos.LocalCluster(hosts=3) as cluster:
        kernel = await cluster.start_kernel()
        result = await kernel.execute("x = 1")
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import msgspec

from nbos.backends.local import LocalProcessBackend
from nbos.cluster._kernel import Kernel, stop_processes
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.config import Settings
from nbos.core.errors import BackendError, ConfigError, KernelError
from nbos.core.ids import HostId, KernelId, new_kernel_id
from nbos.kernel.front import ExecutorChooser, HeartbeatPolicy, KernelFront, ReplicaEndpoint

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
_POLL_S = 0.05


class LocalCluster:
    """``hosts`` virtual hosts on this machine; each kernel gets 3 replicas on 3 of them.

    An async context manager: leaving it shuts every kernel down and removes the
    run directory (logs, object store, Raft logs) unless ``run_dir`` was given.
    ``durable=False`` keeps Raft logs in memory (faster; a replica that restarts
    cannot recover from its own disk then). ``heartbeat`` tunes how fast a kernel's
    front gives up on a replica that stopped answering; ``rebase_bytes`` how many bytes
    of deltas pile up before a replica re-images its namespace for Raft snapshots.
    """

    def __init__(
        self,
        hosts: int = 3,
        *,
        replicas: int = 3,
        run_dir: str | os.PathLike[str] | None = None,
        durable: bool = True,
        settings: Settings | None = None,
        heartbeat: HeartbeatPolicy | None = None,
        rebase_bytes: int | None = None,
        python: str = sys.executable,
    ) -> None:
        if hosts < replicas or replicas < 1:
            raise ConfigError("hosts", hosts, f"at least replicas ({replicas}) hosts")
        self._host_ids = tuple(HostId(f"host-{i}") for i in range(1, hosts + 1))
        self._replicas = replicas
        self._given_run_dir = Path(run_dir) if run_dir is not None else None
        self._durable = durable
        self._settings = settings or Settings()
        self._heartbeat = heartbeat
        self._rebase_bytes = rebase_bytes
        self._python = python
        self._run_dir: Path | None = None
        self._backend: LocalProcessBackend | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._kernels: dict[KernelId, Kernel] = {}
        self._next_host = 0

    @property
    def run_dir(self) -> Path:
        """Where logs, the object store and Raft logs live."""
        if self._run_dir is None:
            raise KernelError("the cluster is not running")
        return self._run_dir

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self._kernels.values() if not k.closed.is_set())

    async def __aenter__(self) -> LocalCluster:
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            if self._given_run_dir is None:
                self._run_dir = Path(tempfile.mkdtemp(prefix="nbos-cluster-"))
                stack.callback(shutil.rmtree, self._run_dir, True)
            else:
                self._run_dir = self._given_run_dir
                self._run_dir.mkdir(parents=True, exist_ok=True)
            self._backend = LocalProcessBackend(self._host_ids, run_dir=self._run_dir / "logs")
            stack.push_async_callback(self._backend.aclose)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._shutdown_kernels)
        except BaseException:
            await stack.__aexit__(*sys.exc_info())
            raise
        self._stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        return await stack.__aexit__(exc_type, exc, tb)

    async def _shutdown_kernels(self) -> None:
        with anyio.CancelScope(shield=True):
            for kernel in list(self._kernels.values()):
                await kernel.shutdown()

    async def start_kernel(self, *, chooser: ExecutorChooser | None = None) -> Kernel:
        """Start a kernel's replicas and its front; returns once every replica answered."""
        if self._tg is None or self._backend is None:
            raise KernelError("start_kernel() outside `async with LocalCluster(...)`")
        kernel_id = new_kernel_id()
        kernel_dir = self.run_dir / "kernels" / kernel_id
        kernel_dir.mkdir(parents=True)
        nodes = list(range(1, self._replicas + 1))
        peers = {n: [_free_address(), _free_address()] for n in nodes}
        handles: dict[int, ProcessHandle] = {}
        specs: dict[int, tuple[HostId, ProcessSpec]] = {}
        try:
            files = {}
            for node, host in zip(nodes, self._pick_hosts(), strict=True):
                files[node] = _seed_connection_file(kernel_dir / f"replica-{node}.json")
                spec = self._replica_spec(kernel_id, node, peers, files[node], kernel_dir)
                specs[node] = (host, spec)
                handles[node] = await self._backend.start(host, spec)
            endpoints = [
                ReplicaEndpoint(node, await _wait_connection_file(files[node], handles[node]))
                for node in nodes
            ]
            front = KernelFront(
                endpoints, kernel_id=kernel_id, chooser=chooser, heartbeat=self._heartbeat
            )
            kernel: Kernel = await self._tg.start(
                self._run_kernel, kernel_id, front, handles, specs
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handle in handles.values():
                    await handle.terminate(grace=1.0)
            raise
        self._kernels[kernel_id] = kernel
        return kernel

    async def _run_kernel(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        handles: dict[int, ProcessHandle],
        specs: dict[int, tuple[HostId, ProcessSpec]],
        *,
        task_status: anyio.abc.TaskStatus[Kernel],
    ) -> None:
        backend = self._backend
        assert backend is not None
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def restart(node: int) -> ProcessHandle:
                    # Same host, ports, keys and Raft log directory as before.
                    handle = await backend.start(*specs[node])
                    tg.start_soon(_watch_process, front, node, handle)
                    return handle

                kernel = Kernel(
                    kernel_id, front, handles, scope, restart if self._durable else None
                )
                for node, handle in handles.items():
                    tg.start_soon(_watch_process, front, node, handle)
                await tg.start(front.serve)
                task_status.started(kernel)
                await front.shutdown_requested.wait()
                # A client shut the kernel down: the replicas were asked to exit.
                with anyio.CancelScope(shield=True):
                    await stop_processes(front, handles)
                kernel.closed.set()
                tg.cancel_scope.cancel()

    def _pick_hosts(self) -> list[HostId]:
        # Round-robin, so kernels spread over the hosts; 3 distinct hosts per kernel.
        n = len(self._host_ids)
        picked = [self._host_ids[(self._next_host + i) % n] for i in range(self._replicas)]
        self._next_host = (self._next_host + 1) % n
        return picked

    def _replica_spec(
        self,
        kernel_id: KernelId,
        node: int,
        peers: dict[int, list[str]],
        connection_file: Path,
        kernel_dir: Path,
    ) -> ProcessSpec:
        argv = [
            self._python,
            "-m",
            "nbos.kernel.replica",
            "--connection-file",
            str(connection_file),
            "--kernel-id",
            kernel_id,
            "--node-id",
            str(node),
            "--raft-peers",
            json.dumps(peers),
            "--store",
            str(self.run_dir / "store"),
            # Each replica keeps its own input history (filled from the log), not a
            # shared sqlite file that three processes would write at once.
            "--HistoryManager.hist_file=:memory:",
        ]
        if self._durable:
            argv += ["--data-dir", str(kernel_dir / f"raft-{node}")]
        argv += ["--raft-settings", msgspec.json.encode(self._settings.raft).decode()]
        if self._rebase_bytes is not None:
            argv.append(f"--ReplicaKernel.rebase_bytes={self._rebase_bytes}")
        return ProcessSpec(argv=argv, label=f"{kernel_id[:8]}-replica-{node}")


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _seed_connection_file(path: Path) -> Path:
    # Ports 0: the replica binds free ports and rewrites the file with them.
    info = {
        "transport": "tcp",
        "ip": "127.0.0.1",
        "key": secrets.token_hex(32),
        "signature_scheme": "hmac-sha256",
        **{f"{c}_port": 0 for c in ("shell", "iopub", "stdin", "control", "hb")},
    }
    path.write_text(json.dumps(info))
    return path


async def _wait_connection_file(path: Path, handle: ProcessHandle) -> dict[str, Any]:
    with anyio.move_on_after(_START_TIMEOUT_S):
        while handle.returncode is None:
            try:
                info: dict[str, Any] = json.loads(await anyio.Path(path).read_text())
            except (OSError, ValueError):
                info = {}
            if info.get("shell_port"):
                return info
            await anyio.sleep(_POLL_S)
        raise BackendError(f"replica exited with status {handle.returncode} at start")
    raise BackendError(f"replica did not write {path} within {_START_TIMEOUT_S} s")


async def _watch_process(front: KernelFront, node: int, handle: ProcessHandle) -> None:
    status = await handle.wait()
    front.mark_dead(node, f"process exited with status {status}")
