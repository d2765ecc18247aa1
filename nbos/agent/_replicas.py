"""The replica processes of one host: started for the gateway, watched, taken back after a restart.

Processes start through :class:`~nbos.backends.LocalProcessBackend` (own session
and process group, one log file each under ``STATE/logs``). Every replica has a
record file under ``STATE/replicas`` holding its PID, the kernel's start time of
that PID (``/proc/PID/stat``, clock ticks since boot) and the boot id, written
when it starts and again when it ends, and the spec it was started with (its owner too,
which every listing reports: the gateway decides on replicas of no kernel it knows by
it), with mode ``0600`` (the spec holds the kernel's keys). An agent that starts over
reads them:

* a record whose process is still there, with the same start time on the same
  boot, is **adopted**: watched through a pidfd and signalled as before. It is
  not the new agent's child, so its exit status is lost (reported as unknown);
* a record whose PID is gone, or now names another process (PID reuse: the start
  time differs), is reported ended with an unknown status, and that process is
  never touched;
* an ended record stays until the gateway acknowledges its ``ReplicaExited``.

With ``[agent] runtime = "docker"`` each replica is a container on the host's
Docker engine instead (:mod:`nbos.agent._runtime`), its output in the engine's
logs. Its record also names the container, and an agent that starts over takes
it back through the engine by that id: a container still there is adopted, its
exit status known even then (the engine keeps it); one that is gone is reported
ended with an unknown status. A container is removed once the gateway
acknowledged its end.

With ``[agent] warm_replicas`` above 0 (processes only) the service keeps that many
pre-started replica processes (:class:`~nbos.agent._warm.WarmPool`) and starts a
replica by handing one out; with ``fork_replicas`` (the default) they are forks of a
template process (:mod:`nbos.agent._template`): their exit status comes from the
template, which reaps them, and is unknown if the template ended first.

Leaving the agent does not stop replicas (the backend is not closed), so a
restarted agent takes them back; :meth:`ReplicaService.stop_all` is the way to
stop them.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import attrs
import msgspec

from nbos.agent._pids import process_start_ticks, read_boot_id, signal_group
from nbos.agent._runtime import container_env, docker_backend, replica_labels
from nbos.agent._template import ForkedProcess
from nbos.agent._warm import WarmPool
from nbos.backends import LocalProcessBackend
from nbos.backends.workdir import (
    expand_argv,
    read_connection_file,
    seed_connection_file,
    workdir_path,
)
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.config import AgentSettings
from nbos.core.errors import BackendError, ConfigError
from nbos.core.ids import HostId
from nbos.core.private_files import private_dir
from nbos.core.wire.agent import ReplicaInfo, ReplicaSpec

if TYPE_CHECKING:
    from nbos.backends.docker import DockerBackend

log = logging.getLogger(__name__)

_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
#: How many acknowledged replica ids are remembered, so a late duplicate start is not obeyed.
_ACKED_MEMORY = 4096

#: ``report(info)``: tell the gateway that a replica ended.
ExitReport = Callable[[ReplicaInfo], Awaitable[None]]


class ReplicaRecord(msgspec.Struct, forbid_unknown_fields=True):
    """What the state directory keeps of one replica (JSON, strictly decoded)."""

    replica_id: str
    label: str
    pid: int
    start_ticks: int | None
    boot_id: str
    started_at: float
    ended: bool = False
    exit_code: int | None = None
    signal: int | None = None
    workdir: str = ""
    #: The replica's container id (runtime docker); ``pid`` is then its init's PID.
    container: str = ""
    #: What it was started with, which a gateway that adopts it rebuilds its kernel from
    #: (``None`` in a record of an older agent).
    spec: ReplicaSpec | None = None


@attrs.frozen
class ExitStatus:
    """How a process ended; both ``None`` when that is unknown (an adopted process)."""

    exit_code: int | None
    signal: int | None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        return cls(None, -returncode) if returncode < 0 else cls(returncode, None)


class _Child:
    """A replica this agent started, or a container: its exit status is known."""

    def __init__(self, handle: ProcessHandle) -> None:
        self._handle = handle

    def running(self) -> bool:
        return self._handle.returncode is None

    async def wait(self) -> ExitStatus:
        return ExitStatus.from_returncode(await self._handle.wait())

    async def signal(self, signum: int) -> None:
        await self._handle.signal(signum)


class _Adopted:
    """A replica an earlier agent started, held through a pidfd (which pins its identity)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._ended = anyio.Event()

    def running(self) -> bool:
        return not self._ended.is_set()

    async def wait(self) -> ExitStatus:
        if not self._ended.is_set():
            # A pidfd turns readable when its process ends.
            await anyio.wait_readable(self._pidfd)
            if not self._ended.is_set():
                self._ended.set()
                os.close(self._pidfd)
        return ExitStatus(None, None)

    async def signal(self, signum: int) -> None:
        if self._ended.is_set():
            return
        # The process group (as the backend signals its children); the pidfd is still
        # open and unread, so its leader has not been reaped.
        signal_group(self.pid, signum)


class _Forked:
    """A replica forked by the host's template, which reaps it and tells its exit status."""

    def __init__(self, process: ForkedProcess) -> None:
        self._process = process

    def running(self) -> bool:
        return self._process.running()

    async def wait(self) -> ExitStatus:
        returncode = await self._process.wait()
        return (
            ExitStatus(None, None) if returncode is None else ExitStatus.from_returncode(returncode)
        )

    async def signal(self, signum: int) -> None:
        await self._process.signal(signum)


_Process = _Child | _Adopted | _Forked


@attrs.define
class _Replica:
    record: ReplicaRecord
    process: _Process | None
    adopted: bool
    stopping: anyio.Event | None = None
    ended: anyio.Event = attrs.Factory(anyio.Event)

    def info(self, *, with_spec: bool = False) -> ReplicaInfo:
        r = self.record
        return ReplicaInfo(
            replica_id=r.replica_id,
            label=r.label,
            handle=f"container:{r.container[:12]}" if r.container else f"pid:{r.pid}",
            pid=r.pid,
            started_at=r.started_at,
            adopted=self.adopted,
            running=not r.ended,
            exit_code=r.exit_code,
            signal=r.signal,
            owner=r.spec.owner if r.spec is not None else None,
            spec=r.spec if with_spec else None,
        )


class UnknownReplicaError(BackendError):
    """No replica of this id is held here."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        super().__init__(f"no replica {replica_id!r} on this host")


class ReplicaService:
    """Starts, watches, signals and stops one host's replicas; build it with :meth:`open`.

    Every method answers for a replica id: an unknown one raises
    :class:`UnknownReplicaError`, a bad spec or id raises :class:`ConfigError` or
    :class:`BackendError`. An ended replica's info goes to ``report`` at once and
    again on every :meth:`report_unacknowledged` until :meth:`acknowledge`.
    """

    def __init__(
        self,
        host: HostId,
        state_dir: Path,
        ip: str,
        report: ExitReport,
        tg: anyio.abc.TaskGroup,
        *,
        settings: AgentSettings,
    ) -> None:
        self._host = host
        self._ip = ip
        self._records = state_dir / "replicas"
        self._work = state_dir.absolute() / "work"
        self._python = settings.python or sys.executable
        self._backend = LocalProcessBackend([host], run_dir=state_dir / "logs")
        self._docker: DockerBackend | None = None
        if settings.runtime == "docker":
            self._docker = docker_backend(host, settings, self._work)
        self._warm = WarmPool(
            self._backend, host, settings.pool_size, tg, python=self._python, fork=settings.forks
        )
        self._report = report
        self._tg = tg
        self._replicas: dict[str, _Replica] = {}
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._starting: dict[str, anyio.Event] = {}
        self._boot_id = read_boot_id()

    @classmethod
    async def open(
        cls,
        host: HostId,
        state_dir: Path,
        ip: str,
        report: ExitReport,
        tg: anyio.abc.TaskGroup,
        *,
        settings: AgentSettings | None = None,
    ) -> ReplicaService:
        """The service, with the replicas recorded in ``state_dir`` taken back.

        ``ip`` is the host's address, which Jupyter connection files name;
        ``settings`` say how replicas run (default: no settings file's, so local
        processes without pre-started ones).
        """
        settings = settings or AgentSettings(warm_replicas=0)
        service = cls(host, state_dir, ip, report, tg, settings=settings)
        try:
            await anyio.Path(service._work).mkdir(parents=True, exist_ok=True)
            await anyio.Path(service._records).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("state_dir", str(state_dir), f"a writable directory ({exc})") from exc
        for path in sorted(service._records.glob("*.json")):
            await service._take_back(path)
        service._warm.fill()
        return service

    async def detach(self) -> None:
        """Let go of the Docker engine (its containers keep running, as processes do)."""
        if self._docker is not None:
            await self._docker.detach()

    # --- queries -----------------------------------------------------------------

    def infos(self, *, with_specs: bool = False) -> list[ReplicaInfo]:
        """Every replica held: running ones and ended ones not yet acknowledged
        (``with_specs``: each with the spec it was started with)."""
        return [r.info(with_spec=with_specs) for r in self._replicas.values()]

    def info(self, replica_id: str) -> ReplicaInfo:
        return self._get(replica_id).info()

    def of_kernel(self, kernel_id: str) -> list[str]:
        """The running replicas of ``kernel_id`` here: those whose workdir is under its name
        (the gateway gives each replica ``KERNEL_ID/replica-N``, see ``ReplicaSpec``)."""
        return [
            rid
            for rid, r in self._replicas.items()
            if not r.record.ended and r.record.workdir.split("/")[0] == kernel_id
        ]

    async def connection(self, replica_id: str) -> dict[str, str | int]:
        """The replica's connection info, empty until its kernel wrote its ports."""
        name = self._get(replica_id).record.workdir
        if not name:
            raise ConfigError("replica_id", replica_id, "a replica started with a workdir")
        info = await anyio.to_thread.run_sync(read_connection_file, workdir_path(self._work, name))
        return {k: v for k, v in (info or {}).items() if isinstance(v, str | int)}

    # --- requests ----------------------------------------------------------------

    async def start(self, replica_id: str, spec: ReplicaSpec) -> ReplicaInfo:
        """Start ``spec`` as ``replica_id``; a known or recently acknowledged id starts nothing."""
        if not _REPLICA_ID.fullmatch(replica_id):
            raise ConfigError("replica_id", replica_id, "1-128 letters, digits, '_', '.', '-'")
        existing = self._replicas.get(replica_id)
        if existing is not None:
            return existing.info()
        if replica_id in self._acked:
            raise UnknownReplicaError(replica_id)
        starting = self._starting.get(replica_id)
        if starting is not None:
            # A resent request while the first one starts it (a container takes seconds).
            await starting.wait()
            return self.info(replica_id)
        self._starting[replica_id] = anyio.Event()
        try:
            return await self._start(replica_id, spec)
        finally:
            self._starting.pop(replica_id).set()

    async def _start(self, replica_id: str, spec: ReplicaSpec) -> ReplicaInfo:
        argv = spec.argv
        if spec.workdir:
            workdir = workdir_path(self._work, spec.workdir)
            await anyio.to_thread.run_sync(self._prepare, workdir, spec)
            argv = expand_argv(argv, workdir, self._python)
        label = spec.label or replica_id
        if self._docker is None:
            local = await self._warm.take(argv, spec.env) or await self._backend.start(
                self._host, ProcessSpec(argv, spec.env, label)
            )
            process: _Process = (
                _Forked(local) if isinstance(local, ForkedProcess) else _Child(local)
            )
            pid, container, where = local.pid, "", str(local.log_path)
        else:
            started = await self._docker.start(
                self._host,
                ProcessSpec(argv, container_env(spec.env), label),
                labels=replica_labels(replica_id, spec),
            )
            process = _Child(started)
            container, where = started.container_id, f"container {started.name}"
            try:
                pid = await started.host_pid()
            except BackendError:  # logged by the backend; the container runs all the same
                pid = 0
        record = ReplicaRecord(
            replica_id,
            spec.label,
            pid,
            process_start_ticks(pid),
            self._boot_id,
            time.time(),
            workdir=spec.workdir,
            container=container,
            spec=spec,
        )
        replica = self._replicas[replica_id] = _Replica(record, process, adopted=False)
        await self._save(record)
        log.info("replica %s started: pid %d (%s)", replica_id, pid, where)
        self._tg.start_soon(self._watch, replica)
        return replica.info()

    async def signal(self, replica_id: str, signum: int) -> ReplicaInfo:
        """Send ``signum`` to a running replica; nothing for an ended one."""
        try:
            signal.Signals(signum)
        except ValueError:
            raise ConfigError("signum", signum, "a signal number") from None
        replica = self._get(replica_id)
        if replica.process is not None and not replica.record.ended:
            await replica.process.signal(signum)
            log.info("replica %s: sent signal %d", replica_id, signum)
        return replica.info()

    async def stop(self, replica_id: str, grace: float) -> ReplicaInfo:
        """SIGTERM (and SIGCONT), SIGKILL after ``grace`` s; returns once it ended.

        A replica still being started is stopped once started: the gateway stops a start
        it gave up on, and that start must not outlive the stop.
        """
        starting = self._starting.get(replica_id)
        if starting is not None:
            await starting.wait()
        replica = self._get(replica_id)
        if replica.stopping is None:
            replica.stopping = anyio.Event()
            self._tg.start_soon(self._terminate, replica, max(grace, 0.0))
        await replica.stopping.wait()
        return replica.info()

    async def acknowledge(self, replica_id: str) -> None:
        """The gateway took note of the replica's end: forget it."""
        replica = self._replicas.get(replica_id)
        if replica is None or not replica.ended.is_set():
            log.debug("ack for %s, which is not an ended replica here", replica_id)
            return
        # The record goes first: once the replica is no longer listed, it is gone from disk.
        await anyio.to_thread.run_sync(self._path(replica_id).unlink, True)
        container = replica.record.container
        if container and self._docker is not None:
            try:
                await self._docker.remove(self._host, container, grace=0)
            except BackendError as exc:  # the engine logged it; the container is left
                log.warning("replica %s: container %s not removed: %s", replica_id, container, exc)
        self._replicas.pop(replica_id, None)  # a duplicate ack may have come meanwhile
        self._acked[replica_id] = None
        while len(self._acked) > _ACKED_MEMORY:
            self._acked.popitem(last=False)

    async def close_warm(self) -> None:
        """Let the pre-started processes go and start no more (the agent is leaving)."""
        await self._warm.aclose()

    async def report_unacknowledged(self) -> None:
        for replica in list(self._replicas.values()):
            if replica.record.ended:
                await self._report(replica.info())

    async def stop_all(self, grace: float) -> None:
        """Stop every running replica (on an agent exit asked to take them along)."""
        async with anyio.create_task_group() as tg:
            for replica_id, replica in list(self._replicas.items()):
                if not replica.record.ended:
                    tg.start_soon(self.stop, replica_id, grace)

    # --- internals ---------------------------------------------------------------

    def _prepare(self, workdir: Path, spec: ReplicaSpec) -> None:
        try:
            private_dir(workdir)
            if spec.connection_key:
                seed_connection_file(workdir, self._ip, spec.connection_key, spec.env)
        except OSError as exc:
            raise BackendError(f"cannot prepare {workdir}: {exc}") from exc

    def _get(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise UnknownReplicaError(replica_id)
        return replica

    async def _terminate(self, replica: _Replica, grace: float) -> None:
        assert replica.stopping is not None
        process = replica.process
        if process is not None and process.running():
            await process.signal(signal.SIGTERM)
            await process.signal(signal.SIGCONT)  # a stopped process must act on it
            with anyio.move_on_after(grace) as scope:
                await replica.ended.wait()
            if scope.cancelled_caught:
                name = replica.record.replica_id
                log.info("replica %s ignored SIGTERM for %.1fs: SIGKILL", name, grace)
                await process.signal(signal.SIGKILL)
        await replica.ended.wait()
        replica.stopping.set()

    async def _watch(self, replica: _Replica) -> None:
        assert replica.process is not None
        status = await replica.process.wait()
        await self._finish(replica, status)

    async def _finish(self, replica: _Replica, status: ExitStatus) -> None:
        replica.record = msgspec.structs.replace(
            replica.record, ended=True, exit_code=status.exit_code, signal=status.signal
        )
        log.info(
            "replica %s (pid %d) ended: exit code %s, signal %s",
            replica.record.replica_id,
            replica.record.pid,
            status.exit_code,
            status.signal,
        )
        # On disk before anyone hears of the end: an acknowledgement (which removes the
        # record) must not be overtaken by this write.
        await self._save(replica.record)
        replica.ended.set()
        await self._report(replica.info())

    async def _take_back(self, path: Path) -> None:
        try:
            data = await anyio.Path(path).read_bytes()
            record = msgspec.json.decode(data, type=ReplicaRecord)
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("replica record %s unreadable, ignored: %s", path, exc)
            return
        process: _Process | None = None
        if record.container and not record.ended:
            process = await self._adopt_container(record)
        elif not record.ended:
            process = self._adopt(record)
        replica = _Replica(record, process, adopted=True)
        if record.ended:
            replica.ended.set()
        self._replicas[record.replica_id] = replica
        if process is not None:
            log.info("replica %s taken back: pid %d", record.replica_id, record.pid)
            self._tg.start_soon(self._watch, replica)
        elif not record.ended:
            self._tg.start_soon(self._finish, replica, ExitStatus(None, None))

    async def _adopt_container(self, record: ReplicaRecord) -> _Child | None:
        """A handle on the recorded container, kept by the engine even once it ended."""
        if self._docker is None:
            log.warning(
                "replica %s ran in container %s, but this agent's runtime is not docker: "
                "reported ended, its container left as it is",
                record.replica_id,
                record.container,
            )
            return None
        try:
            handle = await self._docker.adopt(self._host, record.container)
        except BackendError as exc:
            log.warning("replica %s: container %s: %s", record.replica_id, record.container, exc)
            return None
        return None if handle is None else _Child(handle)

    def _adopt(self, record: ReplicaRecord) -> _Adopted | None:
        """A handle on the recorded process if it is still the one we started, else ``None``."""
        if record.boot_id != self._boot_id or record.start_ticks is None:
            log.info("replica %s: recorded on another boot; not adopted", record.replica_id)
            return None
        try:
            pidfd = os.pidfd_open(record.pid)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                log.warning("replica %s: pidfd_open(%d): %s", record.replica_id, record.pid, exc)
            return None
        # Checked after the pidfd is open: from here on the PID cannot change owner.
        if process_start_ticks(record.pid) != record.start_ticks:
            os.close(pidfd)
            log.warning(
                "replica %s: pid %d now belongs to another process (start time differs); "
                "not adopted",
                record.replica_id,
                record.pid,
            )
            return None
        return _Adopted(record.pid, pidfd)

    def _path(self, replica_id: str) -> Path:
        return self._records / f"{replica_id}.json"

    async def _save(self, record: ReplicaRecord) -> None:
        await anyio.to_thread.run_sync(_write_atomically, self._path(record.replica_id), record)


def _write_atomically(path: Path, record: ReplicaRecord) -> None:
    scratch = path.with_suffix(".tmp")
    # The spec holds secrets (the kernel's CURVE keys): the owner's only.
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(record))
        f.flush()
        os.fsync(f.fileno())
    os.replace(scratch, path)
