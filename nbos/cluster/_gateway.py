"""The gateway's kernels: placement, replicas, fronts, exits, restarts, replacement, migration.

One implementation for every cluster: :class:`Gateway` runs kernels over a
:class:`~nbos.gateway.ReplicaLauncher` and a GPU scheduler. The embedded
:class:`~nbos.cluster.LocalCluster` gives it local processes and in-process agents;
``nbos gateway`` gives it the :class:`~nbos.gateway.AgentBackend` of registered
``nbos agent`` hosts. (It lives here, not in :mod:`nbos.gateway`, because it is built
from this package's kernel, replacement and chooser, which use the scheduler there.)

A kernel's replica ``N`` gets a working directory ``KERNEL/replica-N`` on its host
(its connection file, and its Raft log when durable), Raft and forwarder ports free on
that host, and a connection file naming that host's address: replicas listen on the
address their host is reached at. Fronts bind ``front_ip``.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc
import attrs
import msgspec

from nbos.backends.workdir import PYTHON_TOKEN, WORKDIR_TOKEN
from nbos.cluster._chooser import GpuChooser
from nbos.cluster._kernel import Kernel, stop_processes
from nbos.cluster._replacement import MemberAddress, Replacer, Spawned
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.config import Settings
from nbos.core.errors import ConfigError, UnknownKernelError
from nbos.core.ids import HostId, KernelId, new_kernel_id
from nbos.gateway import GpuScheduler, ReplicaLauncher
from nbos.kernel.front import ExecutorChooser, HeartbeatPolicy, KernelFront, ReplicaEndpoint

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


class KernelGpus(Protocol):
    """The scheduler, and where the GPU side hears of kernels (``ClusterGpus``)."""

    @property
    def scheduler(self) -> GpuScheduler: ...

    def add_kernel(
        self, kernel_id: KernelId, front: KernelFront, hosts: Mapping[int, HostId]
    ) -> None: ...

    async def replica_gone(self, kernel_id: KernelId, host: HostId) -> None: ...

    async def kernel_gone(self, kernel_id: KernelId) -> None: ...


@attrs.frozen
class KernelOptions:
    """What every kernel of a gateway runs with.

    ``store`` is the object store every replica opens (a directory all hosts share,
    or a Redis URL); ``durable`` keeps Raft logs on the hosts' disks;
    ``replace_after_s`` replaces a replica whose process ended, or that the front
    declared dead, and that was not restarted within that many seconds (``None``: never
    by itself); ``fence_dead_replicas`` kills a replica declared dead whose process still
    runs (``False``: it runs on, as on a host nobody can reach to kill it).
    """

    settings: Settings
    store: str
    durable: bool = True
    heartbeat: HeartbeatPolicy | None = None
    rebase_bytes: int | None = None
    replace_after_s: float | None = 1.0
    fence_dead_replicas: bool = True
    front_ip: str = "127.0.0.1"


@attrs.frozen
class _Launch:
    """How replica ``node`` was started, to start it again in place (same ports, same log)."""

    host: HostId
    spec: ProcessSpec
    workdir: str
    key: str

    async def start(self, launcher: ReplicaLauncher) -> ProcessHandle:
        return await launcher.start_replica(
            self.host, self.spec, workdir=self.workdir, connection_key=self.key
        )


class Gateway:
    """Every kernel of one cluster; build it with :meth:`serve`."""

    def __init__(
        self,
        gpus: KernelGpus,
        launcher: ReplicaLauncher,
        options: KernelOptions,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        self.gpus = gpus
        self.launcher = launcher
        self.options = options
        self._tg = tg
        self._kernels: dict[KernelId, Kernel] = {}
        # Each replica's connection info, as its connection file says.
        self._connections: dict[tuple[KernelId, int], Mapping[str, Any]] = {}

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, gpus: KernelGpus, launcher: ReplicaLauncher, options: KernelOptions
    ) -> AsyncIterator[Gateway]:
        """Run kernels until the block exits, which shuts every kernel down."""
        async with anyio.create_task_group() as tg:
            gateway = cls(gpus, launcher, options, tg)
            try:
                yield gateway
            finally:
                await gateway.shutdown_kernels()

    @property
    def scheduler(self) -> GpuScheduler:
        return self.gpus.scheduler

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        """The kernels that are not shut down."""
        return tuple(k for k in self._kernels.values() if not k.closed.is_set())

    def kernel(self, kernel_id: str) -> Kernel:
        """A running kernel; :class:`UnknownKernelError` for any other id."""
        kernel = self._kernels.get(KernelId(kernel_id))
        if kernel is None or kernel.closed.is_set():
            raise UnknownKernelError(KernelId(kernel_id))
        return kernel

    def replica_connection(self, kernel_id: str, node: int) -> Mapping[str, Any]:
        """Replica ``node``'s own connection info (its connection file; ``{}`` if unknown):
        a client on the replica itself, not the front, and where it listens (``ip``)."""
        return self._connections.get((KernelId(kernel_id), node), {})

    async def shutdown_kernels(self) -> None:
        with anyio.CancelScope(shield=True):
            for kernel in list(self._kernels.values()):
                await kernel.shutdown()

    async def start_kernel(
        self,
        *,
        chooser: ExecutorChooser | None = None,
        gpus: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> Kernel:
        """Start a kernel's replicas and its front; returns once every replica answered.

        The placement policy puts the replicas on distinct hosts; ``gpus`` is the
        kernel's GPUs per cell (a cell may ask for another count). ``chooser``
        replaces the GPU-aware executor choice. ``env`` goes into the environment of
        every replica process of the kernel (replacements too). Raises
        :class:`~nbos.core.errors.PlacementError` when the policy cannot place it.
        """
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            raise ConfigError("gpus", gpus, "a non-negative number of GPUs per cell")
        kernel_id = new_kernel_id()
        scheduler = self.gpus.scheduler
        placed = dict(enumerate(scheduler.place(kernel_id, gpus), start=1))
        handles: dict[int, ProcessHandle] = {}
        launches: dict[int, _Launch] = {}
        env = dict(env or {})
        try:
            members = {n: await self._member(h) for n, h in placed.items()}
            for node, host in placed.items():
                launches[node] = self._launch(kernel_id, node, host, members, env)
                handles[node] = await launches[node].start(self.launcher)
            endpoints = [
                ReplicaEndpoint(node, await self._connection(kernel_id, node, handles[node]))
                for node in placed
            ]
            if chooser is None:
                chooser = GpuChooser(scheduler, kernel_id, placed, gpus)
            front = KernelFront(
                endpoints,
                kernel_id=kernel_id,
                ip=self.options.front_ip,
                chooser=chooser,
                heartbeat=self.options.heartbeat,
            )
            self.gpus.add_kernel(kernel_id, front, placed)
            kernel: Kernel = await self._tg.start(
                self._run_kernel,
                kernel_id,
                front,
                handles,
                launches,
                _Replacing(members, chooser, gpus, placed, env),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handle in handles.values():
                    await handle.terminate(grace=1.0)
                await self.gpus.kernel_gone(kernel_id)
            raise
        self._kernels[kernel_id] = kernel
        return kernel

    async def _connection(
        self, kernel_id: KernelId, node: int, handle: ProcessHandle
    ) -> Mapping[str, Any]:
        info = await self.launcher.connection_info(handle, _START_TIMEOUT_S)
        self._connections[(kernel_id, node)] = info
        return info

    async def _member(self, host: HostId) -> MemberAddress:
        raft, forward = await self.launcher.addresses(host, 2)
        return MemberAddress(raft, forward)

    async def _run_kernel(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        handles: dict[int, ProcessHandle],
        launches: dict[int, _Launch],
        replacing: _Replacing,
        *,
        task_status: anyio.abc.TaskStatus[Kernel],
    ) -> None:
        gpus, launcher, options = self.gpus, self.launcher, self.options

        async def watch(node: int, handle: ProcessHandle) -> None:
            status = await handle.wait()
            front.mark_dead(node, f"process exited with status {status}")
            await gpus.replica_gone(kernel_id, launches[node].host)
            if options.replace_after_s is not None:
                await replacer.replace_after_exit(node, handle, options.replace_after_s)

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
                        handle = await launches[node].start(launcher)
                        tg.start_soon(watch, node, handle)
                        return handle

                    async def spawn(
                        node: int, host: HostId, peers: Mapping[int, MemberAddress]
                    ) -> Spawned:
                        launches[node] = self._launch(
                            kernel_id, node, host, peers, replacing.env, join=True
                        )
                        handle = await launches[node].start(launcher)
                        tg.start_soon(watch, node, handle)
                        try:
                            info = await self._connection(kernel_id, node, handle)
                        except BaseException:
                            with anyio.CancelScope(shield=True):
                                await handle.terminate(grace=1.0)
                            raise
                        return Spawned(handle, info)

                    replacer = Replacer(
                        kernel_id=kernel_id,
                        front=front,
                        processes=handles,
                        members=dict(replacing.members),
                        spawn=spawn,
                        place=lambda k, exclude: gpus.scheduler.decisions.place_one(
                            gpus.scheduler.view(), k, replacing.gpus, exclude
                        ),
                        new_member=self._member,
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
                        restart if options.durable else None,
                        replacer=replacer,
                    )

                    def declared_dead(node: int, reason: str) -> None:
                        # At the kernel's end, that end stops them all.
                        if options.fence_dead_replicas and not front.is_closing:
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
            for key in [k for k in self._connections if k[0] == kernel_id]:
                del self._connections[key]
            await gpus.kernel_gone(kernel_id)

    def _launch(
        self,
        kernel_id: KernelId,
        node: int,
        host: HostId,
        members: Mapping[int, MemberAddress],
        env: Mapping[str, str],
        *,
        join: bool = False,
    ) -> _Launch:
        """Replica ``node`` of ``kernel_id`` on ``host``; ``join``: a replacement's."""
        options = self.options
        peers = {n: [a.raft, a.forward] for n, a in members.items()}
        argv = [
            PYTHON_TOKEN,
            "-m",
            "nbos.kernel.replica",
            "--connection-file",
            f"{WORKDIR_TOKEN}/connection.json",
            "--kernel-id",
            kernel_id,
            "--node-id",
            str(node),
            "--raft-peers",
            json.dumps(peers),
            "--store",
            options.store,
            # Each replica keeps its own input history (filled from the log), not a
            # shared sqlite file that three processes would write at once.
            "--HistoryManager.hist_file=:memory:",
        ]
        if options.durable:
            argv += ["--data-dir", f"{WORKDIR_TOKEN}/raft"]
        argv += ["--raft-settings", msgspec.json.encode(options.settings.raft).decode()]
        if options.rebase_bytes is not None:
            argv.append(f"--ReplicaKernel.rebase_bytes={options.rebase_bytes}")
        if join:
            argv.append("--join")
        if self.launcher.virtual_gpus(host):
            argv.append("--ReplicaApp.virtual_gpus=True")
        spec = ProcessSpec(argv=argv, env=env, label=f"{kernel_id[:8]}-replica-{node}")
        return _Launch(host, spec, f"{kernel_id}/replica-{node}", secrets.token_hex(32))


@attrs.frozen
class _Replacing:
    """What replacing a kernel's replicas needs: peer addresses, chooser, GPUs per cell,
    the node -> host map that the GPU eviction routes read (kept up to date), and the
    replicas' extra environment."""

    members: Mapping[int, MemberAddress]
    chooser: ExecutorChooser
    gpus: int
    hosts: dict[int, HostId]
    env: Mapping[str, str]

    def replica_replaced(self, dead: int, node: int, host: HostId) -> None:
        self.hosts.pop(dead, None)
        self.hosts[node] = host
