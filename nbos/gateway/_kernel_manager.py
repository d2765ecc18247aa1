"""The gateway's kernels: placement, replicas, fronts, exits, restarts, replacement, migration.

One implementation for every cluster: :class:`KernelManager` runs kernels over a
:class:`~nbos.gateway.ReplicaLauncher` and a GPU scheduler. The embedded
:class:`~nbos.cluster.LocalCluster` gives it local processes and in-process agents;
``nbos gateway`` gives it the :class:`~nbos.gateway.AgentBackend` of registered
``nbos agent`` hosts. (It lives here, not in :mod:`nbos.gateway`, because it is built
from this package's kernel, replacement and chooser, which use the scheduler there.)

A kernel's replica ``N`` gets a working directory ``KERNEL/replica-N`` on its host
(its connection file, and its Raft log when durable), a Raft port free on that host,
and a connection file naming that host's address: replicas listen on the address
their host is reached at. Fronts bind ``front_ip``.

Durability: given a :class:`~nbos.gateway._state.StateFile` (``nbos gateway`` with a
data dir), the gateway rewrites it whenever its kernels change (a kernel started, shut
down or lost, a replica restarted or replaced), and :meth:`KernelManager.restore` takes the
kernels it names back after a restart: the replicas kept running on their hosts (the
launcher adopts them), each front binds its old ports with its old key, and the cells
go on from the replicas' log. The embedded cluster keeps no state file. With a state
file, leaving :meth:`KernelManager.serve` (however: a signal, a crash) leaves every kernel
running and the file as it is; only :meth:`KernelManager.shutdown_kernels` (or one
kernel's shutdown) takes kernels off it.

What is acknowledged is on disk first. A start is recorded as *starting* (its kernel id
and hosts) before any replica of it starts, and as a kernel once its replicas and front
run; :meth:`KernelManager.start_kernel` returns only after that second write, and a
write that fails (:class:`~nbos.core.errors.StateWriteError`: ``ENOSPC``, ``EIO``) fails
the start: what it started is stopped and its GPUs released, the other kernels run on.
A shutdown asked of the gateway (:meth:`Kernel.shutdown`) is recorded before the
replicas are stopped, so that no record outlives them to bring the kernel back; a write
that fails refuses the shutdown and the kernel runs on. Other writes (a replica
restarted or replaced, a kernel lost) that fail are logged and retried: the gateway's
memory is the truth, and the next write that succeeds catches the file up.

With :attr:`KernelOptions.curve` (``nbos gateway`` with keys) every kernel gets a
CURVE key pair of its own at its start (:func:`~nbos.transport.keys.kernel_keys_env`),
in the environment of each of its replicas (replacements and restarts too, and in
the state file): their Raft links admit only that pair.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio
import anyio.abc
import attrs
import msgspec

from nbos.backends.workdir import PYTHON_TOKEN, WORKDIR_TOKEN
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.config import Settings
from nbos.core.errors import (
    ConfigError,
    HostUnreachableError,
    NbosError,
    OverloadedError,
    PlacementError,
    PolicyContractError,
    QuorumLostError,
    StateWriteError,
    UnknownKernelError,
)
from nbos.core.ids import HostId, KernelId, new_kernel_id
from nbos.core.replica_launcher import AdoptingLauncher, ReplicaLauncher
from nbos.core.wire.agent import ReplicaOwner
from nbos.gateway._admission import StartAdmission
from nbos.gateway._agent_backend import HOST_LOST_STATUS
from nbos.gateway._executor_choice import GpuChooser
from nbos.gateway._kernel import Kernel, stop_processes
from nbos.gateway._replacement import Replacer, Spawn, Spawned
from nbos.gateway._replica_watch import ReplicaWatch
from nbos.gateway._scheduler import GpuScheduler
from nbos.gateway._state import (
    FrontRecord,
    GatewayState,
    KernelRecord,
    ReplicaRecord,
    StartRecord,
    StateFile,
    StateWriter,
)
from nbos.kernel.front import (
    ExecutorChooser,
    FrontIdentity,
    HeartbeatPolicy,
    KernelFront,
    ReplicaEndpoint,
)
from nbos.kernel.protocol import RAFT_STATE_GONE_STATUS
from nbos.transport.keys import kernel_keys_env

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_START_TIMEOUT_S = 60.0
#: How long a start that no host has room for waits for the autoscaler to add one: within
#: the control API clients' timeouts (120 s), so that none gives up on a start that goes on.
HOST_WAIT_S = 60.0
# How long after a state write failed the gateway tries again (a full disk may be freed).
_RETRY_WRITE_S = 5.0
#: The waits between rounds of restarts in place of a kernel without a majority (doubling):
#: its replicas' hosts may take long to come back (a power cut).
RECOVERY_BACKOFF_S = (1.0, 10.0)


@attrs.define
class StartUnderWay:
    """A kernel start not ended yet: whose, its GPUs per cell, when it was asked (UNIX
    seconds), and why it waits while it waits for a host (``None``: it is not waiting)."""

    kernel_id: KernelId
    owner: str
    gpus: int
    asked_at: float
    waiting: str | None = None


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
    ``replace_after_s`` replaces a replica whose process ended and that was not
    restarted within that many seconds (``None``: never by itself);
    ``replace_suspected_after_s`` one that is only suspected (the front's heartbeats
    go unanswered, or its host is silent) for that long, while the others keep a
    majority (``None``: never); a suspected replica is never killed, only stopped once
    its replacement took its place in the kernel's Raft membership. A kernel that lost
    its majority (no replacement can commit then) restarts its dead replicas in place
    from their disks instead, when ``durable`` and unless ``replace_after_s`` is
    ``None``; ``curve``
    gives each kernel a CURVE key pair of its own for its replicas' Raft
    links (only where the links to the agents, which carry it, are CURVE too).
    """

    settings: Settings
    store: str
    durable: bool = True
    heartbeat: HeartbeatPolicy | None = None
    rebase_bytes: int | None = None
    replace_after_s: float | None = 1.0
    replace_suspected_after_s: float | None = 30.0
    front_ip: str = "127.0.0.1"
    curve: bool = False


@attrs.frozen
class _Launch:
    """How replica ``node`` was started, to start it again in place (same ports, same log)."""

    host: HostId
    spec: ProcessSpec
    workdir: str
    key: str
    owner: ReplicaOwner | None

    @property
    def durable(self) -> bool:
        """Whether the replica keeps its Raft state on its host's disk (and so can restart)."""
        return "--data-dir" in self.spec.argv

    async def start(self, launcher: ReplicaLauncher) -> ProcessHandle:
        return await launcher.start_replica(
            self.host, self.spec, workdir=self.workdir, connection_key=self.key, owner=self.owner
        )

    async def restart(self, launcher: ReplicaLauncher) -> ProcessHandle:
        """Start it again in place from its Raft state on its host's disk; a replica whose
        state is gone from there exits with :data:`RAFT_STATE_GONE_STATUS`."""
        spec = ProcessSpec([*self.spec.argv, "--recover"], self.spec.env, self.spec.label)
        return await launcher.start_replica(
            self.host, spec, workdir=self.workdir, connection_key=self.key
        )


@attrs.frozen
class _NotBack:
    """Why a kernel of the state file is not back; ``waits``: it may come back later."""

    text: str
    waits: bool


@attrs.frozen
class _Tracked:
    """A running kernel's bookkeeping, shared with its task: what its record is made of."""

    front: KernelFront
    handles: Mapping[int, ProcessHandle]
    launches: Mapping[int, _Launch]
    replacing: _Replacing


def _restart_identity(connection: Mapping[str, Any] | None) -> FrontIdentity | None:
    """The identity a restarted kernel's front takes from the connection info it replaces."""
    if not connection:
        return None
    names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
    ports = {n: connection[n] for n in names if isinstance(connection.get(n), int)}
    key = connection.get("key")
    if not isinstance(key, str) or not key:
        raise ConfigError("connection.key", key, "the key of the kernel restarted")
    return FrontIdentity(key, None, ports)


class KernelManager:
    """Every kernel of one cluster; build it with :meth:`serve`."""

    def __init__(
        self,
        gpus: KernelGpus,
        launcher: ReplicaLauncher,
        options: KernelOptions,
        tg: anyio.abc.TaskGroup,
        state: StateFile | None = None,
    ) -> None:
        if state is not None and not isinstance(launcher, AdoptingLauncher):
            raise ConfigError("state", str(state.path), "a launcher whose replicas outlive it")
        self.gpus = gpus
        self.launcher = launcher
        self.options = options
        self._tg = tg
        self._kernels: dict[KernelId, Kernel] = {}
        #: The user of every kernel run since the start, ended ones too (their figures).
        self.owners: dict[KernelId, str] = {}
        # Each replica's connection info, as its connection file says.
        self._connections: dict[tuple[KernelId, int], Mapping[str, Any]] = {}
        self._state = state
        self._state_id = state.state_id if state is not None else ""
        self._writer = StateWriter(state) if state is not None else None
        self._retrying = False
        self._tracked: dict[KernelId, _Tracked] = {}
        # Starts not acknowledged yet, and their hosts: recorded as starting.
        self._starting: dict[KernelId, list[HostId]] = {}
        # Starts under way (until their kernel runs or they fail), and why each waits.
        self._starts: dict[KernelId, StartUnderWay] = {}
        # Kernels whose shutdown is being recorded: in no record any more.
        self._ending: set[KernelId] = set()
        #: How many starts run at once (``[gateway] max_starting``); restores are not starts.
        self.admission = StartAdmission(
            options.settings.gateway.max_starting, options.settings.gateway.start_wait_s
        )
        # The kernels the manager let go on running without it as it exited (see serve).
        self._left_running: set[KernelId] = set()
        # Set once a kernel's task ended: its record is off the state file then.
        self._ends: dict[KernelId, anyio.Event] = {}
        # Kernels of the state file not back yet (their records, and why), and lost ones.
        self._recovering: dict[KernelId, tuple[KernelRecord, str]] = {}
        self._lost: dict[KernelId, str] = {}

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        gpus: KernelGpus,
        launcher: ReplicaLauncher,
        options: KernelOptions,
        *,
        state: StateFile | None = None,
    ) -> AsyncIterator[KernelManager]:
        """Run kernels until the block exits.

        ``state``: keep the kernels there (the launcher must be an
        :class:`~nbos.gateway.AdoptingLauncher`); :meth:`restore` takes them back.
        Leaving the block, however it is left (an exception, a cancellation), shuts
        every kernel down only without a state file. With one, the kernels run on and
        the file is left as it is, for the next manager's :meth:`restore`: shutting
        them down is then explicit (:meth:`shutdown_kernels`).
        """
        async with anyio.create_task_group() as tg:
            gateway = cls(gpus, launcher, options, tg, state)
            try:
                yield gateway
            finally:
                if state is None:
                    await gateway.shutdown_kernels()
                else:
                    gateway._detach()

    def _detach(self) -> None:
        """Stop serving the kernels and leave their replicas, GPUs and record alone."""
        assert self._state is not None  # only a manager with a state file can be taken back
        self._left_running = {k.kernel_id for k in self.kernels}
        if self._left_running:
            log.info("%d kernels left running, kept in %s", len(self.kernels), self._state.path)
        self._tg.cancel_scope.cancel()

    @property
    def scheduler(self) -> GpuScheduler:
        return self.gpus.scheduler

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        """The kernels that are not shut down."""
        return tuple(k for k in self._kernels.values() if not k.closed.is_set())

    def terms(self, kernel_id: str) -> tuple[int, float] | None:
        """A running kernel's GPUs per cell and when it was first started (UNIX seconds,
        kept across gateway restarts); ``None`` for a kernel not (or no longer) tracked."""
        tracked = self._tracked.get(KernelId(kernel_id))
        if tracked is None:
            return None
        return tracked.replacing.gpus, tracked.replacing.started_at

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
        """Shut every kernel down; returns once none whose shutdown was recorded is in the
        state file any more (one whose shutdown could not be recorded runs on)."""
        # Those whose task runs for sure (a start cancelled early may never run its task).
        ends = {k: self._ends[k] for k in self._kernels if k in self._ends}
        # All at once: each waits up to its grace for its replicas, and 50 kernels
        # one after another took a gateway's SIGTERM over a minute.
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for kernel in list(self._kernels.values()):
                    tg.start_soon(self._shutdown_or_keep, kernel, ends.get(kernel.kernel_id))

    async def _shutdown_or_keep(self, kernel: Kernel, ended: anyio.Event | None) -> None:
        try:
            await kernel.shutdown()
        except StateWriteError as exc:
            failed = exc
        else:
            if ended is not None:
                await ended.wait()
            return
        log.error("kernel %s left running, its record kept: %s", kernel.kernel_id, failed)

    async def start_kernel(
        self,
        *,
        chooser: ExecutorChooser | None = None,
        gpus: int = 0,
        connection: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        owner: str = "",
        kernel_id: KernelId | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> Kernel:
        """Start a kernel's replicas and its front; returns once every replica answered.

        The placement policy puts the replicas on distinct hosts; ``gpus`` is the
        kernel's GPUs per cell (a cell may ask for another count). ``chooser``
        replaces the GPU-aware executor choice. ``connection`` gives the front the
        ``key`` and ports (``shell_port`` ...) of a kernel it replaces (a restart).
        ``env`` goes into the environment of every replica process of the kernel
        (replacements too). ``owner``: the user it belongs to (kept in the state file).
        ``kernel_id``: the id to give it (default: a new one).

        A kernel no host has room for now waits for one while the autoscaler may add
        hosts (:meth:`~nbos.scaling.ClusterDecisions.may_grow`, as in the simulator):
        it is in :attr:`starts_waiting` with why, ``on_wait(why)`` is called once, and it
        is placed when a host joins (or room frees up), for at most :data:`HOST_WAIT_S`.

        Raises :class:`~nbos.core.errors.OverloadedError`, starting nothing, when
        ``[gateway] max_starting`` starts run already and none ended within ``[gateway]
        start_wait_s``, or at once when no host has room for the
        replicas and none can be added (no autoscaler, its ceiling ``max_hosts``, or the
        wait for a host ran out), :class:`~nbos.core.errors.PolicyContractError`
        for a policy that broke its contract, and
        :class:`~nbos.core.errors.StateWriteError` when the gateway's state holding it
        could not be written (nothing of it is left running then).
        """
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            raise ConfigError("gpus", gpus, "a non-negative number of GPUs per cell")
        await self.admission.wait()
        kernel_id = kernel_id if kernel_id is not None else new_kernel_id()
        start = self._starts[kernel_id] = StartUnderWay(kernel_id, owner, gpus, time.time())
        try:
            placed = dict(enumerate(await self._placement(start, on_wait), start=1))
            try:
                with self.admission.slot():
                    return await self._start_kernel(
                        kernel_id,
                        placed,
                        chooser=chooser,
                        gpus=gpus,
                        connection=connection,
                        env=env,
                        owner=owner,
                    )
            except OverloadedError:
                # No slot once it was placed: its placement goes, nothing of it started.
                await self.gpus.kernel_gone(kernel_id)
                raise
        finally:
            del self._starts[kernel_id]

    @property
    def starts_waiting(self) -> Mapping[KernelId, str]:
        """Starts waiting for a host, with why (the autoscaler counts them as placement failed)."""
        return {k: s.waiting for k, s in self._starts.items() if s.waiting is not None}

    def start_under_way(self, kernel_id: KernelId) -> StartUnderWay | None:
        """The start of ``kernel_id`` while it runs (its kernel may run already)."""
        return self._starts.get(kernel_id)

    @property
    def starts(self) -> tuple[StartUnderWay, ...]:
        """The starts under way whose kernel does not run yet (waiting for a host, or
        starting its replicas), oldest first: what the kernel lists show as ``starting``."""
        return tuple(s for k, s in self._starts.items() if k not in self._kernels)

    async def _placement(
        self, start: StartUnderWay, on_wait: Callable[[str], None] | None
    ) -> tuple[HostId, ...]:
        """Hosts for the kernel's replicas, waiting for one while the autoscaler may add it;
        :class:`OverloadedError` when none has room and none can be added."""
        kernel_id, gpus = start.kernel_id, start.gpus
        scheduler = self.gpus.scheduler
        deadline = anyio.current_time() + HOST_WAIT_S
        try:
            while True:
                version = scheduler.version
                try:
                    return scheduler.place(kernel_id, gpus)
                except PolicyContractError:
                    raise
                except PlacementError as exc:
                    failed = exc
                view = scheduler.view()
                grows = scheduler.decisions.may_grow(view, gpus, scheduler.provisioning)
                if not grows or anyio.current_time() >= deadline:
                    raise self.admission.refuse(self._no_room(failed, gpus, grows)) from failed
                if start.waiting is None:
                    start.waiting = why = f"waiting for a host: {failed}"
                    log.info("kernel %s %s", kernel_id, why)
                    if on_wait is not None:
                        on_wait(why)
                await scheduler.changed(version)
        finally:
            start.waiting = None

    def _no_room(self, failed: PlacementError, gpus: int, grows: bool) -> str:
        """Why a start is refused for want of room: the placement's error, the full hosts,
        and what keeps the autoscaler from adding one."""
        scheduler = self.gpus.scheduler
        full = scheduler.model.full_hosts()
        why = f"{failed}; hosts at their limits: {', '.join(full)}" if full else str(failed)
        autoscaler = scheduler.decisions.autoscaler
        if grows:
            why += f"; no host joined within {HOST_WAIT_S:g} s"
        elif autoscaler is not None and gpus > autoscaler.config.new_host_gpus:
            why += f"; a new host of {autoscaler.config.new_host_gpus} GPUs could not take it"
        elif autoscaler is not None:
            why += f"; the autoscaler is at its ceiling (max_hosts={autoscaler.config.max_hosts})"
        return f"no room for the kernel's replicas ({why})"

    async def _start_kernel(
        self,
        kernel_id: KernelId,
        placed: dict[int, HostId],
        *,
        chooser: ExecutorChooser | None,
        gpus: int,
        connection: Mapping[str, Any] | None,
        env: Mapping[str, str] | None,
        owner: str,
    ) -> Kernel:
        scheduler = self.gpus.scheduler
        handles: dict[int, ProcessHandle] = {}
        launches: dict[int, _Launch] = {}
        front: KernelFront | None = None
        env = dict(env or {})
        if self.options.curve:
            env |= kernel_keys_env()
        try:
            self._starting[kernel_id] = list(placed.values())
            await self._write_state()  # no replica starts that a restart could not stop
            # The three replicas' round trips to their agents go at once, not one by one.
            members = await _each(placed, lambda node: self._member(placed[node]))
            for node, host in placed.items():
                launches[node] = self._launch(
                    kernel_id, node, host, members, env, gpus=gpus, user=owner
                )
            await _each(placed, partial(self._start_replica, launches, handles))
            infos = await _each(
                placed, lambda node: self._connection(kernel_id, node, handles[node])
            )
            endpoints = [ReplicaEndpoint(node, infos[node]) for node in placed]
            if chooser is None:
                chooser = GpuChooser(scheduler, kernel_id, placed, gpus, user=owner)
            front = KernelFront(
                endpoints,
                kernel_id=kernel_id,
                ip=self.options.front_ip,
                chooser=chooser,
                heartbeat=self.options.heartbeat,
                identity=_restart_identity(connection),
            )
            replacing = _Replacing(
                members, chooser, gpus, placed, self._persist_soon, env, owner, time.time()
            )
            kernel = await self._serve(kernel_id, front, handles, launches, replacing)
        except BaseException:
            self._starting.pop(kernel_id, None)
            if front is not None:
                front.close()
            with anyio.CancelScope(shield=True):
                for handle in handles.values():
                    await handle.terminate(grace=1.0)
                await self.gpus.kernel_gone(kernel_id)
            raise
        self._kernels[kernel_id] = kernel
        await self._acknowledge(kernel)
        return kernel

    async def _acknowledge(self, kernel: Kernel) -> None:
        """Record ``kernel`` as running, or stop it and raise :class:`StateWriteError`."""
        hosts = self._starting.pop(kernel.kernel_id)
        try:
            await self._write_state()
        except StateWriteError as exc:
            failed = exc
        else:
            return
        log.error("kernel %s not started: %s", kernel.kernel_id, failed)
        # Still a start on disk: its shutdown records nothing, and a restart stops it.
        self._starting[kernel.kernel_id] = hosts
        with anyio.CancelScope(shield=True):
            await kernel.shutdown()
        self._starting.pop(kernel.kernel_id, None)
        raise failed

    async def _serve(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        handles: dict[int, ProcessHandle],
        launches: dict[int, _Launch],
        replacing: _Replacing,
    ) -> Kernel:
        """Run a kernel whose replicas and front exist: its GPUs, its task, the kernel."""
        self.owners[kernel_id] = replacing.owner
        self.gpus.add_kernel(kernel_id, front, replacing.hosts)
        self._ends[kernel_id] = anyio.Event()
        kernel: Kernel = await self._tg.start(
            self._run_kernel, kernel_id, front, handles, launches, replacing
        )
        return kernel

    async def restore(self, records: Sequence[KernelRecord], timeout: float) -> list[Kernel]:
        """Take back the kernels of ``records``, run by this gateway before it restarted.

        Their replicas' hosts get ``timeout`` seconds to register. A replica that ended
        meanwhile, or whose host did not come, is replaced as any dead one (after
        ``replace_after_s``) once the kernel is back, unless that left no majority
        running (after a restart of the whole cluster, none): then the kernel's ended
        replicas are restarted in place from their Raft state on their hosts' disks.
        A kernel whose majority is not back in time is kept (in the state file too, and
        in :attr:`recovering`) and taken back in the background once its hosts are. A
        kernel a majority of whose replicas lost their Raft state (their disks), or whose
        front cannot bind its old ports, is lost: logged, kept in :attr:`lost` with why,
        its replicas stopped. Returns the kernels taken back.
        """
        async with anyio.create_task_group() as tg:
            for record in records:
                tg.start_soon(partial(self._tg.start, self._restore_one, record, timeout))
        await self._persist()
        return [k for r in records if (k := self._kernels.get(KernelId(r.kernel_id)))]

    @property
    def state_id(self) -> str:
        """The id of the gateway state this manager writes (empty without one): the owner
        its replicas carry."""
        return self._state_id

    @property
    def recovering(self) -> Mapping[KernelId, str]:
        """Kernels of the state file whose majority is not back yet, with why."""
        return {k: why for k, (_, why) in self._recovering.items()}

    @property
    def lost(self) -> Mapping[KernelId, str]:
        """Kernels of the state file that could not be taken back, with why."""
        return dict(self._lost)

    async def _restore_one(
        self, record: KernelRecord, timeout: float, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Take one kernel back; ``task_status`` once it is, or lost, or known to wait for
        its hosts (then it goes on waiting here)."""
        assert isinstance(self.launcher, AdoptingLauncher)  # checked by the constructor
        kernel_id = KernelId(record.kernel_id)
        handles: dict[int, ProcessHandle] = {}
        try:
            async with anyio.create_task_group() as tg:
                for replica in record.replicas:
                    tg.start_soon(self._adopt, handles, replica, timeout)
        except* (NbosError, OSError) as group:
            why: _NotBack | None = _NotBack(f"its replicas could not be adopted: {group}", False)
        else:
            why = await self._take_back(record, handles)
        backoff, most = RECOVERY_BACKOFF_S
        waiting = False
        while why is not None and why.waits:
            if not waiting:
                waiting = True
                log.warning("kernel %s is not back yet: %s", kernel_id, why.text)
                self._recovering[kernel_id] = (record, why.text)
                task_status.started()
            await anyio.sleep(backoff)
            backoff = min(2 * backoff, most)
            why = await self._take_back(record, handles)
        self._recovering.pop(kernel_id, None)
        if why is not None:
            self._lost[kernel_id] = why.text
            await self._give_up(kernel_id, handles, why.text)
        if waiting:
            await self._persist()
        else:
            task_status.started()

    async def _take_back(
        self, record: KernelRecord, handles: dict[int, ProcessHandle]
    ) -> _NotBack | None:
        """One try at taking ``record``'s kernel back with ``handles`` (restarting those of
        its replicas that ended); ``None`` once it is back, else why not."""
        kernel_id = KernelId(record.kernel_id)
        launches = {r.node: self._launch_of(record, r) for r in record.replicas}
        failures: list[Exception] = []
        front: KernelFront | None = None
        try:
            placed = {r.node: HostId(r.host) for r in record.replicas}
            members = {r.node: r.raft for r in record.replicas}
            for r in record.replicas:
                self._connections[(kernel_id, r.node)] = r.connection
            chooser = GpuChooser(
                self.gpus.scheduler, kernel_id, placed, record.gpus, user=record.owner
            )
            env = dict(record.replicas[0].env) if record.replicas else {}
            front = KernelFront(
                [ReplicaEndpoint(r.node, r.connection) for r in record.replicas],
                kernel_id=kernel_id,
                ip=record.front.ip,
                chooser=chooser,
                heartbeat=self.options.heartbeat,
                identity=_identity(record.front),
                resume=True,
            )
            # Only once the front holds its old ports again: the processes started here
            # make connections, whose source ports may be any free one, its own too.
            await self._restart_without_majority(kernel_id, launches, handles)
            self.gpus.scheduler.adopt_placement(kernel_id, placed.values(), record.gpus)
            replacing = _Replacing(
                members,
                chooser,
                record.gpus,
                placed,
                self._persist_soon,
                env,
                record.owner,
                # A state file from before start times: known from the take-back on.
                record.started_at or time.time(),
            )
            kernel = await self._serve(kernel_id, front, handles, launches, replacing)
        # The front's start fails inside the kernel's task group: an exception group.
        except* (NbosError, OSError) as group:
            failures.extend(group.exceptions)
        else:
            self._kernels[kernel_id] = kernel
            log.info("kernel %s taken back: replicas %s alive", kernel_id, sorted(front.alive))
            return None
        finally:
            if front is not None and kernel_id not in self._kernels:
                front.close()
        why: BaseException = failures[0]
        while isinstance(why, BaseExceptionGroup):  # the first error, not its wrapping
            why = why.exceptions[0]
        if not isinstance(why, QuorumLostError):
            return _NotBack(f"it could not be taken back: {why}", waits=False)
        gone = {
            n: launches[n].host
            for n, handle in handles.items()
            if handle.returncode == RAFT_STATE_GONE_STATUS
        }
        if 2 * (len(launches) - len(gone)) <= len(launches):
            return _NotBack(_disks_gone(gone), waits=False)
        return _NotBack(f"no majority of its replicas is back ({why})", waits=True)

    async def _restart_without_majority(
        self,
        kernel_id: KernelId,
        launches: Mapping[int, _Launch],
        handles: dict[int, ProcessHandle],
    ) -> None:
        """Restart ``handles``' ended replicas in place, unless a majority runs: then the
        kernel comes back at once, and they take the way of any dead one (replaced)."""
        running = [n for n, h in handles.items() if h.returncode is None]
        if 2 * len(running) > len(launches):
            return
        for node, launch in launches.items():
            if handles[node].returncode is not None and launch.durable:
                try:
                    handles[node] = await self._again(launch, handles[node])
                except NbosError as exc:
                    log.info("kernel %s: replica %d not back yet: %s", kernel_id, node, exc)

    async def _give_up(
        self, kernel_id: KernelId, handles: Mapping[int, ProcessHandle], why: str
    ) -> None:
        log.error("kernel %s is lost: %s", kernel_id, why)
        for key in [k for k in self._connections if k[0] == kernel_id]:
            del self._connections[key]
        with anyio.CancelScope(shield=True):
            for handle in handles.values():
                if handle.returncode is None:
                    await handle.terminate(grace=1.0)
            await self.gpus.kernel_gone(kernel_id)

    async def _adopt(
        self, handles: dict[int, ProcessHandle], replica: ReplicaRecord, timeout: float
    ) -> None:
        assert isinstance(self.launcher, AdoptingLauncher)
        handles[replica.node] = await self.launcher.adopt(
            HostId(replica.host), replica.process, timeout
        )

    def _persist_soon(self) -> None:
        if self._state is not None:
            self._tg.start_soon(self._persist)

    async def _persist(self) -> None:
        """Write the state file (if any) as the kernels are now; a failure is logged and
        the write tried again later (what was to be written is not an answer's)."""
        try:
            await self._write_state()
        except StateWriteError as exc:
            failed = exc
        else:
            return
        log.error("%s; tried again in %g s", failed, _RETRY_WRITE_S)
        if not self._retrying:
            self._retrying = True
            self._tg.start_soon(self._persist_later)

    async def _persist_later(self) -> None:
        await anyio.sleep(_RETRY_WRITE_S)
        self._retrying = False
        await self._persist()

    async def _write_state(self) -> None:
        """Write the state file (if any) as the kernels are now, or raise
        :class:`StateWriteError` (the file then is as it was)."""
        if self._writer is None:
            return
        with anyio.CancelScope(shield=True):
            await self._writer.write(self._snapshot)

    def _snapshot(self, generation: int) -> GatewayState:
        running = [
            self._record(k, t)
            for k, t in self._tracked.items()
            if k not in self._starting and k not in self._ending
        ]
        # Not back yet, but not lost: a later start may take them back too.
        running += [r for k, (r, _) in self._recovering.items() if k not in self._tracked]
        starting = [StartRecord(kernel_id=k, hosts=list(h)) for k, h in self._starting.items()]
        return GatewayState(
            state_id=self._state_id,
            generation=generation,
            kernels=running,
            starting=starting,
        )

    async def _retire(self, kernel_id: KernelId) -> None:
        """Record that ``kernel_id`` is shut down, before its replicas stop: a record left
        behind would bring it back. Raises :class:`StateWriteError` (it runs on then)."""
        if self._state is None or kernel_id in self._starting:
            return  # a start is stopped by a restart anyway
        self._ending.add(kernel_id)
        try:
            await self._write_state()
        except StateWriteError:
            self._ending.discard(kernel_id)
            raise

    def _record(self, kernel_id: KernelId, tracked: _Tracked) -> KernelRecord:
        assert isinstance(self.launcher, AdoptingLauncher)
        replicas = []
        for node, handle in sorted(tracked.handles.items()):
            launch = tracked.launches.get(node)
            member = tracked.replacing.members.get(node)
            connection = self._connections.get((kernel_id, node))
            if launch is None or member is None or connection is None:
                continue  # a replacement half way: it joins no record until it has joined
            replicas.append(
                ReplicaRecord(
                    node=node,
                    host=launch.host,
                    process=self.launcher.process_id(handle),
                    workdir=launch.workdir,
                    key=launch.key,
                    argv=list(launch.spec.argv),
                    env=dict(launch.spec.env),
                    label=launch.spec.label,
                    raft=member,
                    connection=_plain(connection),
                )
            )
        identity = tracked.front.identity
        front = FrontRecord(
            ip=str(tracked.front.connection_info["ip"]),
            key=identity.key,
            session=tracked.front.session_id,
            **{name: identity.ports[name] for name in _PORTS},
        )
        return KernelRecord(
            kernel_id=kernel_id,
            gpus=tracked.replacing.gpus,
            front=front,
            replicas=replicas,
            owner=tracked.replacing.owner,
            started_at=tracked.replacing.started_at,
        )

    async def _connection(
        self, kernel_id: KernelId, node: int, handle: ProcessHandle
    ) -> Mapping[str, Any]:
        info = await self.launcher.connection_info(handle, _START_TIMEOUT_S)
        self._connections[(kernel_id, node)] = info
        return info

    async def _start_replica(
        self, launches: Mapping[int, _Launch], handles: dict[int, ProcessHandle], node: int
    ) -> None:
        handles[node] = await launches[node].start(self.launcher)

    async def _member(self, host: HostId) -> str:
        """A Raft address for a new replica on ``host``."""
        (raft,) = await self.launcher.addresses(host, 1)
        return raft

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
        kernel: Kernel | None = None
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def restart(node: int) -> ProcessHandle:
                        # Same host, ports, keys and Raft log directory as before.
                        handle = await replacer.restart(node, partial(self._again, launches[node]))
                        tg.start_soon(watcher.watch, node, handle)
                        # Runs once the kernel holds the new handle (it does on return).
                        self._persist_soon()
                        return handle

                    async def spawn(node: int, host: HostId, peers: Mapping[int, str]) -> Spawned:
                        launches[node] = self._launch(
                            kernel_id,
                            node,
                            host,
                            peers,
                            replacing.env,
                            gpus=replacing.gpus,
                            user=replacing.owner,
                            join=True,
                        )
                        handle = await launches[node].start(launcher)
                        tg.start_soon(watcher.watch, node, handle)
                        try:
                            info = await self._connection(kernel_id, node, handle)
                        except BaseException:
                            with anyio.CancelScope(shield=True):
                                await handle.terminate(grace=1.0)
                            raise
                        return Spawned(handle, info)

                    replacer = self._replacer(kernel_id, front, handles, replacing, spawn)
                    heals = options.durable and options.replace_after_s is not None
                    kernel = Kernel(
                        kernel_id,
                        front,
                        handles,
                        scope,
                        restart if options.durable else None,
                        replacer=replacer,
                        retire=partial(self._retire, kernel_id),
                        owner=replacing.owner,
                        gpus=replacing.gpus,
                        heals=heals,
                    )

                    async def after_exit(node: int, handle: ProcessHandle) -> None:
                        replace = partial(self._replace_dead, replacer)
                        if not (
                            heals and self._brings_back(tg, kernel, handles, launches, replace)
                        ):
                            await replace(node, handle)

                    watcher = ReplicaWatch(
                        front,
                        handles,
                        replacer,
                        lambda node: gpus.replica_gone(kernel_id, launches[node].host),
                        after_exit,
                        options.replace_suspected_after_s,
                        tg,
                    )
                    front.on_dead(watcher.declared_dead)
                    for node, handle in handles.items():
                        tg.start_soon(watcher.watch, node, handle)
                    await tg.start(front.serve)
                    watcher.serving.set()
                    self._tracked[kernel_id] = _Tracked(front, handles, launches, replacing)
                    task_status.started(kernel)
                    await front.shutdown_requested.wait()
                    # A client shut the kernel down: the replicas were asked to exit.
                    replacer.close()
                    with anyio.CancelScope(shield=True):
                        await stop_processes(front, handles)
                    kernel.closed.set()
                    tg.cancel_scope.cancel()
        finally:
            if kernel is not None:
                kernel.let_go()
            await self._kernel_ended(kernel_id, front)

    async def _again(self, launch: _Launch, ended: ProcessHandle) -> ProcessHandle:
        """The process of replica ``launch`` again after ``ended`` ended: taken back if its
        host was only given up for lost and it runs on there (a second process would find
        its Raft log locked), else restarted in place from its Raft state on its host's
        disk. Raises :class:`~nbos.core.errors.BackendError` while the host is not back.
        """
        launcher = self.launcher
        if ended.returncode == HOST_LOST_STATUS and isinstance(launcher, AdoptingLauncher):
            again = await launcher.adopt(launch.host, launcher.process_id(ended), 0.0)
            if again.returncode is None:
                return again
            if again.returncode == HOST_LOST_STATUS:
                raise HostUnreachableError(launch.host, "not back yet")
        return await launch.restart(launcher)

    async def _replace_dead(self, replacer: Replacer, node: int, handle: ProcessHandle) -> None:
        """The policy for replica ``node``, whose process ``handle`` ended: replaced."""
        if self.options.replace_after_s is not None:
            await replacer.replace_after_exit(node, handle, self.options.replace_after_s)

    def _brings_back(
        self,
        tg: anyio.abc.TaskGroup,
        kernel: Kernel,
        handles: Mapping[int, ProcessHandle],
        launches: Mapping[int, _Launch],
        replace: Callable[[int, ProcessHandle], Coroutine[Any, Any, None]],
    ) -> bool:
        """Whether ``kernel`` is bringing its dead replicas back itself: it lost its
        majority (then ``tg`` starts that now), or it is doing so already."""
        front = kernel.front
        if kernel.recovering:
            return True
        if front.has_quorum or front.is_closing or kernel.lost is not None:
            return False
        # No replacement can commit without a majority: the dead restart in place.
        kernel.recovering = True
        tg.start_soon(self._recover, kernel, handles, launches, replace)
        return True

    async def _recover(
        self,
        kernel: Kernel,
        handles: Mapping[int, ProcessHandle],
        launches: Mapping[int, _Launch],
        replace: Callable[[int, ProcessHandle], Coroutine[Any, Any, None]],
    ) -> None:
        """Bring ``kernel``, which lost its majority, back: restart its dead replicas in
        place, round after round while their hosts are away, until a majority is back,
        and once more those that died meanwhile; the rest are ``replace``d. Or, once a
        majority's disks turned out to have lost their Raft state, the kernel is lost
        (:attr:`Kernel.lost`)."""
        front = kernel.front
        log.warning(
            "kernel %s lost its majority (replicas %s alive): restarting the dead in place",
            kernel.kernel_id,
            list(front.alive),
        )
        gone: dict[int, HostId] = {}
        tried: set[int] = set()
        backoff, most = RECOVERY_BACKOFF_S
        try:
            while not front.is_closing:
                dead = {r.node for r in kernel.replicas if not r.alive} - gone.keys()
                if front.has_quorum:
                    dead -= tried  # the majority is back: one try for those that died since
                if not dead:
                    break
                tried |= dead
                async with anyio.create_task_group() as tg:
                    for node in dead:
                        tg.start_soon(
                            self._restart_in_place, kernel, node, handles, launches[node], gone
                        )
                members = len(kernel.replicas)
                if 2 * (members - len(gone)) <= members:
                    kernel.lost = _disks_gone(gone)
                    log.error("kernel %s is lost: %s", kernel.kernel_id, kernel.lost)
                    return
                if not front.has_quorum:
                    await anyio.sleep(backoff)
                    backoff = min(2 * backoff, most)
        finally:
            kernel.recovering = False
        if front.is_closing:
            return
        log.info("kernel %s is back: replicas %s alive", kernel.kernel_id, list(front.alive))
        async with anyio.create_task_group() as tg:
            for node in {r.node for r in kernel.replicas if not r.alive}:
                tg.start_soon(replace, node, handles[node])

    @staticmethod
    async def _restart_in_place(
        kernel: Kernel,
        node: int,
        handles: Mapping[int, ProcessHandle],
        launch: _Launch,
        gone: dict[int, HostId],
    ) -> None:
        try:
            await kernel.restart_replica(node, timeout=_START_TIMEOUT_S)
        except NbosError as exc:
            why = str(exc)
        else:
            return
        ended = handles.get(node)  # None: replaced meanwhile
        if ended is None or ended.returncode != RAFT_STATE_GONE_STATUS:
            log.info("kernel %s: replica %d not back yet: %s", kernel.kernel_id, node, why)
            return
        gone[node] = launch.host
        log.error(
            "kernel %s: replica %d cannot restart: its Raft state is gone from %s's disk",
            kernel.kernel_id,
            node,
            launch.host,
        )

    async def _kernel_ended(self, kernel_id: KernelId, front: KernelFront) -> None:
        try:
            front.closing()
            if kernel_id in self._left_running:
                return  # it runs on: its GPUs and record stay as the agents and file hold them
            for key in [k for k in self._connections if k[0] == kernel_id]:
                del self._connections[key]
            if self._tracked.pop(kernel_id, None) is not None:
                await self._persist()
            self._ending.discard(kernel_id)
            await self.gpus.kernel_gone(kernel_id)
        finally:
            self._ends.pop(kernel_id).set()

    def _replacer(
        self,
        kernel_id: KernelId,
        front: KernelFront,
        handles: dict[int, ProcessHandle],
        replacing: _Replacing,
        spawn: Spawn,
    ) -> Replacer:
        scheduler = self.gpus.scheduler
        replacer = Replacer(
            kernel_id=kernel_id,
            front=front,
            processes=handles,
            members=replacing.members,
            spawn=spawn,
            place=lambda k, exclude: scheduler.decisions.place_one(
                scheduler.view(), k, replacing.gpus, exclude
            ),
            new_member=self._member,
            listeners=(replacing, replacing.chooser),
        )
        if isinstance(replacing.chooser, GpuChooser):
            replacing.chooser.enable_migration(
                lambda node, host, after: replacer.replace(node, target=host, after=after),
            )
        return replacer

    def _launch(
        self,
        kernel_id: KernelId,
        node: int,
        host: HostId,
        members: Mapping[int, str],
        env: Mapping[str, str],
        *,
        gpus: int,
        user: str,
        join: bool = False,
    ) -> _Launch:
        """Replica ``node`` of ``kernel_id`` (``gpus`` per cell, ``user``'s) on ``host``;
        ``join``: a replacement's."""
        options = self.options
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
            json.dumps(members),
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
        owner = self._owner(kernel_id, node, members[node], gpus, user)
        return _Launch(host, spec, f"{kernel_id}/replica-{node}", secrets.token_hex(32), owner)

    def _owner(
        self, kernel_id: str, node: int, raft: str, gpus: int, user: str
    ) -> ReplicaOwner | None:
        if self._writer is None:
            return None
        # A file of this generation or later that does not name the replica dropped it.
        written = self._writer.written
        return ReplicaOwner(self._state_id, written, kernel_id, node, raft, gpus, user)

    def _launch_of(self, kernel: KernelRecord, replica: ReplicaRecord) -> _Launch:
        spec = ProcessSpec(argv=list(replica.argv), env=dict(replica.env), label=replica.label)
        owner = self._owner(kernel.kernel_id, replica.node, replica.raft, kernel.gpus, kernel.owner)
        return _Launch(HostId(replica.host), spec, replica.workdir, replica.key, owner)


@attrs.frozen
class _Replacing:
    """What replacing a kernel's replicas needs: peer addresses (the replacer keeps them
    up to date), chooser, GPUs per cell, the node -> host map that the GPU eviction
    routes read (kept up to date), who hears that the kernel's replicas changed, the
    replicas' extra environment, the user the kernel belongs to, and when it was started
    (UNIX seconds)."""

    members: dict[int, str]
    chooser: ExecutorChooser
    gpus: int
    hosts: dict[int, HostId]
    changed: Callable[[], None]
    env: Mapping[str, str]
    owner: str
    started_at: float

    def replica_replaced(self, dead: int, node: int, host: HostId) -> None:
        self.hosts.pop(dead, None)
        self.hosts[node] = host
        # Called before the replacer updates its maps; the write runs after it did.
        self.changed()


_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def _identity(front: FrontRecord) -> FrontIdentity:
    ports = {name: int(getattr(front, name)) for name in _PORTS}
    return FrontIdentity(front.key, front.session, ports)


def _plain(connection: Mapping[str, Any]) -> dict[str, str | int]:
    """Connection info as the state file keeps it (a key given as bytes as text)."""
    out: dict[str, str | int] = {}
    for name, value in connection.items():
        if isinstance(value, bytes):
            out[name] = value.decode()
        elif isinstance(value, str | int):
            out[name] = value
    return out


def _disks_gone(gone: Mapping[int, HostId]) -> str:
    """Why a kernel whose replicas ``gone`` lost their Raft state cannot come back."""
    where = ", ".join(f"replica {node} on {host}" for node, host in sorted(gone.items()))
    return (
        f"the Raft state of a majority of its replicas is gone from their hosts' disks ({where}):"
        " its acknowledged namespace cannot be recovered"
    )


async def _each(nodes: Iterable[int], step: Callable[[int], Awaitable[_T]]) -> dict[int, _T]:
    """``step(node)`` for every node at once; what each returned, once all returned.

    Each step runs to its end even when another failed (a replica started meanwhile must
    be in the caller's hands to be stopped); then the first failure is raised.
    """
    done: dict[int, _T] = {}
    failed: list[BaseException] = []

    async def one(node: int) -> None:
        try:
            done[node] = await step(node)
        except Exception as exc:  # raised below, once the others ended
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        for node in nodes:
            tg.start_soon(one, node)
    if failed:
        raise failed[0]
    return done
