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
import signal
import sys
import tempfile
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import attrs
import msgspec

from nbos.backends.local import LocalProcessBackend
from nbos.cluster._chooser import GpuChooser
from nbos.cluster._gpus import ClusterGpus
from nbos.cluster._kernel import Kernel, stop_processes
from nbos.cluster._replacement import MemberAddress, Replacer, Spawned
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.config import Settings
from nbos.core.errors import BackendError, ConfigError, KernelError
from nbos.core.ids import HostId, KernelId, new_kernel_id
from nbos.gpu.inventory import DiscoveryMode
from nbos.kernel.front import ExecutorChooser, HeartbeatPolicy, KernelFront, ReplicaEndpoint
from nbos.transport.ports import free_loopback_address

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
    ``replace_dead_replicas``: a replica whose process exited, or that the front
    declared dead (missed heartbeats; its process is killed then), and that was not
    restarted within ``replace_after_s`` seconds is replaced by a new one on another
    host, retried with backoff (``Kernel.replace_replica`` does it on demand;
    ``docs/kernel.md``). ``fence_dead_replicas=False`` leaves a replica declared dead
    running, as on a host the cluster cannot reach to kill it: the replica's own checks
    then keep it from running a cell the kernel gave up on.

    GPUs: every host has an agent owning ``settings.cluster.gpus_per_host`` virtual
    GPUs, or this machine's NVML GPUs where there are some (``gpu_discovery``:
    ``"auto"``, ``"virtual"``, ``"nvml"``); kernels are placed by the policy named
    ``settings.cluster.placement_policy`` and each cell's executor is chosen by GPUs
    (:attr:`gpus`, ``docs/kernel.md``).
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
        gpu_discovery: DiscoveryMode = "auto",
        replace_dead_replicas: bool = True,
        replace_after_s: float = 1.0,
        fence_dead_replicas: bool = True,
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
        self._gpu_discovery: DiscoveryMode = gpu_discovery
        self._replace_after_s = replace_after_s if replace_dead_replicas else None
        self._fence = fence_dead_replicas
        self._gpus: ClusterGpus | None = None
        self._run_dir: Path | None = None
        self._backend: LocalProcessBackend | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._kernels: dict[KernelId, Kernel] = {}

    @property
    def run_dir(self) -> Path:
        """Where logs, the object store and Raft logs live."""
        if self._run_dir is None:
            raise KernelError("the cluster is not running")
        return self._run_dir

    @property
    def gpus(self) -> ClusterGpus:
        """The host agents and the GPU scheduler."""
        if self._gpus is None:
            raise KernelError("the cluster is not running")
        return self._gpus

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
            cluster_settings = msgspec.structs.replace(
                self._settings.cluster, replicas_per_kernel=self._replicas
            )
            self._gpus = await stack.enter_async_context(
                ClusterGpus.serve(self._host_ids, cluster_settings, discovery=self._gpu_discovery)
            )
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

    async def start_kernel(
        self, *, chooser: ExecutorChooser | None = None, gpus: int = 0
    ) -> Kernel:
        """Start a kernel's replicas and its front; returns once every replica answered.

        The placement policy puts the replicas on distinct hosts; ``gpus`` is the
        kernel's GPUs per cell (a cell may ask for another count). ``chooser``
        replaces the GPU-aware executor choice. Raises
        :class:`~nbos.core.errors.PlacementError` when the policy cannot place it.
        """
        if self._tg is None or self._backend is None or self._gpus is None:
            raise KernelError("start_kernel() outside `async with LocalCluster(...)`")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            raise ConfigError("gpus", gpus, "a non-negative number of GPUs per cell")
        kernel_id = new_kernel_id()
        kernel_dir = self.run_dir / "kernels" / kernel_id
        kernel_dir.mkdir(parents=True)
        nodes = list(range(1, self._replicas + 1))
        peers = {n: [free_loopback_address(), free_loopback_address()] for n in nodes}
        handles: dict[int, ProcessHandle] = {}
        specs: dict[int, tuple[HostId, ProcessSpec]] = {}
        placed = dict(zip(nodes, self._gpus.scheduler.place(kernel_id, gpus), strict=True))
        try:
            files = {}
            for node, host in placed.items():
                files[node] = _seed_connection_file(kernel_dir / f"replica-{node}.json")
                spec = self._replica_spec(kernel_id, node, peers, files[node], kernel_dir)
                specs[node] = (host, spec)
                handles[node] = await self._backend.start(host, spec)
            endpoints = [
                ReplicaEndpoint(node, await _wait_connection_file(files[node], handles[node]))
                for node in nodes
            ]
            if chooser is None:
                chooser = GpuChooser(self._gpus.scheduler, kernel_id, placed, gpus)
            front = KernelFront(
                endpoints, kernel_id=kernel_id, chooser=chooser, heartbeat=self._heartbeat
            )
            self._gpus.add_kernel(kernel_id, front, placed)
            members = {n: MemberAddress(*peers[n]) for n in nodes}
            kernel: Kernel = await self._tg.start(
                self._run_kernel,
                kernel_id,
                front,
                handles,
                specs,
                _Replacing(members, chooser, gpus, placed),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handle in handles.values():
                    await handle.terminate(grace=1.0)
                await self._gpus.kernel_gone(kernel_id)
            raise
        self._kernels[kernel_id] = kernel
        return kernel

    async def _run_kernel(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        handles: dict[int, ProcessHandle],
        specs: dict[int, tuple[HostId, ProcessSpec]],
        replacing: _Replacing,
        *,
        task_status: anyio.abc.TaskStatus[Kernel],
    ) -> None:
        backend, gpus = self._backend, self._gpus
        assert backend is not None and gpus is not None

        async def watch(node: int, handle: ProcessHandle) -> None:
            await _watch_process(front, node, handle)
            await gpus.replica_gone(kernel_id, specs[node][0])
            if self._replace_after_s is not None:
                await replacer.replace_after_exit(node, handle, self._replace_after_s)

        async def fence(node: int) -> None:
            # The front gave up on a replica whose process still runs (frozen, or too
            # slow to answer): it goes, so that it can neither run a cell nor vote again.
            # Its exit then takes the path of any other (restart in place, replacement).
            handle = handles.get(node)
            if handle is None or handle.returncode is not None or front.is_closing:
                return
            log.warning("kernel %s: replica %d declared dead: killing %r", kernel_id, node, handle)
            await handle.signal(signal.SIGKILL)

        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def restart(node: int) -> ProcessHandle:
                        # Same host, ports, keys and Raft log directory as before.
                        handle = await backend.start(*specs[node])
                        tg.start_soon(watch, node, handle)
                        return handle

                    async def spawn(
                        node: int, host: HostId, peers: Mapping[int, MemberAddress]
                    ) -> Spawned:
                        handle = await self._start_joining(kernel_id, node, host, peers, specs)
                        tg.start_soon(watch, node, handle)
                        file = self.run_dir / "kernels" / kernel_id / f"replica-{node}.json"
                        try:
                            return Spawned(handle, await _wait_connection_file(file, handle))
                        except BaseException:
                            with anyio.CancelScope(shield=True):
                                await handle.terminate(grace=1.0)
                            raise

                    replacer = Replacer(
                        kernel_id=kernel_id,
                        front=front,
                        processes=handles,
                        members=dict(replacing.members),
                        spawn=spawn,
                        place=lambda k, exclude: gpus.scheduler.decisions.place_one(
                            gpus.scheduler.view(), k, replacing.gpus, exclude
                        ),
                        new_address=free_loopback_address,
                        listeners=(replacing, replacing.chooser),
                    )
                    if isinstance(replacing.chooser, GpuChooser):
                        replacing.chooser.enable_migration(
                            lambda node, host, after: replacer.replace(
                                node, target=host, after=after
                            ),
                        )
                    kernel = Kernel(
                        kernel_id,
                        front,
                        handles,
                        scope,
                        restart if self._durable else None,
                        replacer=replacer,
                    )

                    def declared_dead(node: int, reason: str) -> None:
                        # At the kernel's end, that end stops them all.
                        if self._fence and not front.is_closing:
                            tg.start_soon(fence, node)

                    front.on_dead(declared_dead)
                    for node, handle in handles.items():
                        tg.start_soon(watch, node, handle)
                    await tg.start(front.serve)
                    task_status.started(kernel)
                    await front.shutdown_requested.wait()
                    # A client shut the kernel down: the replicas were asked to exit.
                    replacer.close()
                    with anyio.CancelScope(shield=True):
                        await stop_processes(front, handles)
                    kernel.closed.set()
                    tg.cancel_scope.cancel()
        finally:
            front.closing()
            await gpus.kernel_gone(kernel_id)

    async def _start_joining(
        self,
        kernel_id: KernelId,
        node: int,
        host: HostId,
        peers: Mapping[int, MemberAddress],
        specs: dict[int, tuple[HostId, ProcessSpec]],
    ) -> ProcessHandle:
        """Start replica ``node`` (a replacement) in join mode on ``host``."""
        assert self._backend is not None
        kernel_dir = self.run_dir / "kernels" / kernel_id
        file = _seed_connection_file(kernel_dir / f"replica-{node}.json")
        addresses = {n: [a.raft, a.forward] for n, a in peers.items()}
        spec = self._replica_spec(kernel_id, node, addresses, file, kernel_dir, join=True)
        specs[node] = (host, spec)  # a restart in place starts it again from its log
        return await self._backend.start(host, spec)

    def _replica_spec(
        self,
        kernel_id: KernelId,
        node: int,
        peers: dict[int, list[str]],
        connection_file: Path,
        kernel_dir: Path,
        *,
        join: bool = False,
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
        if join:
            argv.append("--join")
        if self.gpus.inventory.source == "virtual":
            argv.append("--ReplicaApp.virtual_gpus=True")
        return ProcessSpec(argv=argv, label=f"{kernel_id[:8]}-replica-{node}")


@attrs.frozen
class _Replacing:
    """What replacing a kernel's replicas needs: peer addresses, chooser, GPUs per cell,
    and the node -> host map that the GPU eviction routes read (kept up to date)."""

    members: Mapping[int, MemberAddress]
    chooser: ExecutorChooser
    gpus: int
    hosts: dict[int, HostId]

    def replica_replaced(self, dead: int, node: int, host: HostId) -> None:
        self.hosts.pop(dead, None)
        self.hosts[node] = host


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
