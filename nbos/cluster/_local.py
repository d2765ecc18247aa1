"""The embedded local cluster: virtual hosts on this machine, replicated kernels on them.

::

    async with nbos.LocalCluster(hosts=3) as cluster:
        kernel = await cluster.start_kernel()
        result = await kernel.execute("x = 1")
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType

import msgspec

from nbos.backends.local import LocalProcessBackend
from nbos.core.config import Settings
from nbos.core.errors import ConfigError, KernelError
from nbos.core.ids import HostId
from nbos.gateway import ClusterGpus, Kernel, KernelManager, KernelOptions, LocalLauncher
from nbos.gpu.inventory import DiscoveryMode
from nbos.kernel.front import ExecutorChooser, HeartbeatPolicy

log = logging.getLogger(__name__)


class LocalCluster:
    """``hosts`` virtual hosts on this machine; each kernel gets 3 replicas on 3 of them.

    An async context manager: leaving it shuts every kernel down and removes the
    run directory (logs, object store, Raft logs) unless ``run_dir`` was given.
    ``durable=False`` keeps Raft logs in memory (faster; a replica that restarts
    cannot recover from its own disk then). ``heartbeat`` tunes how fast a kernel's
    front gives up on a replica that stopped answering; ``rebase_bytes`` how many bytes
    of deltas pile up before a replica re-images its namespace for Raft snapshots.
    ``replace_dead_replicas``: a replica whose process exited and that was not
    restarted within ``replace_after_s`` seconds is replaced by a new one on another
    host, retried with backoff (``Kernel.replace_replica`` does it on demand;
    ``docs/kernel.md``); one the front gave up on (missed heartbeats) is never killed
    for it: it is used again if it answers, and replaced if it stays silent for
    ``replace_suspected_after_s`` seconds (stopped only once its place is taken).

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
        replace_suspected_after_s: float = 30.0,
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
        self._replace_suspected_after_s = (
            replace_suspected_after_s if replace_dead_replicas else None
        )
        self._gpus: ClusterGpus | None = None
        self._run_dir: Path | None = None
        self._kernel_manager: KernelManager | None = None
        self._stack: AsyncExitStack | None = None

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
    def kernel_manager(self) -> KernelManager:
        """The kernel manager running the kernels (that of ``nbos gateway``, over local hosts)."""
        if self._kernel_manager is None:
            raise KernelError("the cluster is not running")
        return self._kernel_manager

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return self._kernel_manager.kernels if self._kernel_manager is not None else ()

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
            backend = LocalProcessBackend(self._host_ids, run_dir=self._run_dir / "logs")
            stack.push_async_callback(backend.aclose)
            cluster_settings = msgspec.structs.replace(
                self._settings.cluster, replicas_per_kernel=self._replicas
            )
            self._gpus = await stack.enter_async_context(
                ClusterGpus.serve(self._host_ids, cluster_settings, discovery=self._gpu_discovery)
            )
            inventory = self._gpus.inventory
            assert inventory is not None  # in-process agents, found by serve()
            launcher = LocalLauncher(
                backend,
                self._run_dir / "kernels",
                virtual_gpus=inventory.source == "virtual",
                python=self._python,
            )
            options = KernelOptions(
                settings=self._settings,
                store=str(self._run_dir / "store"),
                durable=self._durable,
                heartbeat=self._heartbeat,
                rebase_bytes=self._rebase_bytes,
                replace_after_s=self._replace_after_s,
                replace_suspected_after_s=self._replace_suspected_after_s,
            )
            self._kernel_manager = await stack.enter_async_context(
                KernelManager.serve(self._gpus, launcher, options)
            )
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

    async def start_kernel(
        self, *, chooser: ExecutorChooser | None = None, gpus: int = 0
    ) -> Kernel:
        """Start a kernel's replicas and its front; returns once every replica answered.

        The placement policy puts the replicas on distinct hosts; ``gpus`` is the
        kernel's GPUs per cell (a cell may ask for another count). ``chooser``
        replaces the GPU-aware executor choice. Raises
        :class:`~nbos.core.errors.OverloadedError` (a ``PlacementError``) when
        ``[gateway] max_starting`` starts run already and none ended within ``[gateway]
        start_wait_s``, or at once when no host has room for it.
        """
        if self._kernel_manager is None:
            raise KernelError("start_kernel() outside `async with LocalCluster(...)`")
        return await self._kernel_manager.start_kernel(chooser=chooser, gpus=gpus)
