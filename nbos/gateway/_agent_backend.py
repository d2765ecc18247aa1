"""A ``ComputeBackend`` whose hosts are the registered ``nbos agent`` daemons.

``start(host, spec)`` asks the host's agent to start the process
(``ReplicaStart``, resent until answered: the agent starts a replica id once);
the handle's ``wait()`` ends when the agent reports ``ReplicaExited`` (which the
directory acknowledges); ``signal`` and ``terminate`` go through ``ReplicaSignal`` and
``ReplicaStop``. So the gateway's kernel code runs unchanged over remote hosts.

What loopback hid, the backend adds for replicas (:meth:`AgentBackend.addresses`,
:meth:`AgentBackend.start_replica`, :meth:`AgentBackend.connection_info`): ports
free on the replica's own host, a working directory and a seeded connection file
there, and the connection info read back from that host.

Suspicion is not proof. A suspected host's processes are only *suspected* with it
(:attr:`AgentProcessHandle.suspected`): their handles go on, and they are used again
when the host is heard from, as they were. A handle ends only on proof: its agent
reports the exit, or says it runs no such replica. A process the gateway asked to stop
(its kernel shut down, it was replaced) while its host could not be reached is
*retired*: its handle ends with :data:`HOST_LOST_STATUS`, and the process is stopped
when its host is back.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs

from nbos.backends import HandleBase, check_start
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError, HostUnreachableError
from nbos.core.ids import HostId
from nbos.core.wire.agent import (
    AgentError,
    PortsGranted,
    PortsRequest,
    ReplicaConnection,
    ReplicaConnectionRequest,
    ReplicaInfo,
    ReplicaList,
    ReplicaListRequest,
    ReplicaOwner,
    ReplicaReply,
    ReplicaRequest,
    ReplicaSignal,
    ReplicaSpec,
    ReplicaStart,
    ReplicaState,
    ReplicaStop,
)
from nbos.gateway._directory import HostDirectory, RegisteredHost

log = logging.getLogger(__name__)


@attrs.frozen
class Stray:
    """A running replica that no handle of the gateway names: its host, what its agent
    reports of it (with its spec), and its connection info (empty if unknown)."""

    host: HostId
    info: ReplicaInfo
    connection: dict[str, str | int]


#: The exit status of a process asked to stop while its host could not be reached: it
#: may still run there, cut off, and is stopped when the host is back.
HOST_LOST_STATUS = -255
#: The exit status of a process that ended while its agent was down (not its child then).
UNKNOWN_STATUS = -254
_CONNECTION_POLL_S = 0.1
# How long after SIGKILL a stop may take on the agent, on top of the grace.
_STOP_SLACK_S = 10.0
# A start may pull nothing but still create and start a container (runtime docker),
# seconds on a loaded engine: more than the usual answer's time.
_START_TIMEOUT_S = 30.0
# Between attempts at stopping a retired replica whose host does not answer.
_RETIRE_RETRY_S = 1.0
_RETIRE_RETRY_MAX_S = 30.0


class AgentProcessHandle(HandleBase):
    """A process an agent runs for the gateway; see the module docstring."""

    def __init__(self, backend: AgentBackend, host: HostId, replica_id: str) -> None:
        super().__init__(host)
        self._backend = backend
        self.replica_id = replica_id
        self.pid: int | None = None
        self._suspected = False
        self._suspicion = anyio.Event()
        self._returncode: int | None = None
        self._ended = anyio.Event()

    def __repr__(self) -> str:
        return f"<AgentProcessHandle {self.replica_id} on {self._host} rc={self._returncode}>"

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        await self._ended.wait()
        assert self._returncode is not None
        return self._returncode

    @property
    def suspected(self) -> bool:
        """Its host is suspected: the process may run on, cut off (see the module docstring)."""
        return self._suspected

    @suspected.setter
    def suspected(self, value: bool) -> None:
        if value and not self._suspected:
            self._suspicion.set()
        elif not value and self._suspected:
            self._suspicion = anyio.Event()
        self._suspected = value

    async def wait_suspected(self) -> None:
        if self._returncode is None:
            await self._suspicion.wait()

    async def signal(self, signum: int) -> None:
        if self._returncode is None:
            await self._backend._request(
                self, lambda rid: ReplicaSignal(rid, self.replica_id, signum)
            )

    async def terminate(self, grace: float = 5.0) -> int:
        """``ReplicaStop`` on the agent: SIGTERM, SIGKILL after ``grace``; the exit status."""
        if self._returncode is None:
            try:
                await self._backend._request(
                    self,
                    lambda rid: ReplicaStop(rid, self.replica_id, grace),
                    timeout=grace + _STOP_SLACK_S,
                )
            except HostUnreachableError as exc:
                self._backend._retire(self, str(exc))
        return await self.wait()

    def _end(self, status: int) -> None:
        if self._returncode is None:
            self._returncode = status
            self._ended.set()
            self._suspicion.set()  # its watchers end too


class AgentBackend:
    """Starts processes through the agents of ``directory``'s hosts; build with :meth:`serve`."""

    def __init__(self, directory: HostDirectory, tg: anyio.abc.TaskGroup) -> None:
        self._directory = directory
        self._tg = tg
        self._handles: dict[str, AgentProcessHandle] = {}
        # Replicas asked to stop while their hosts were unreachable: stopped when back.
        self._retired: dict[str, HostId] = {}
        self._closed = False

    @classmethod
    async def open(cls, directory: HostDirectory, tg: anyio.abc.TaskGroup) -> AgentBackend:
        """The backend of ``directory``'s hosts; ``tg`` runs its background stops."""
        backend = cls(directory, tg)
        directory.add_listener(backend)
        return backend

    @property
    def name(self) -> str:
        return "agent"

    def hosts(self) -> Sequence[HostId]:
        return [h.host_id for h in self._directory.hosts() if not h.suspected]

    def ip(self, host: HostId) -> str:
        """The address ``host`` is reached at."""
        return self._directory.live(host).ip

    def virtual_gpus(self, host: HostId) -> bool:
        return self._directory.live(host).gpu_source == "virtual"

    # --- ComputeBackend ----------------------------------------------------------

    async def start(self, host: HostId, spec: ProcessSpec) -> AgentProcessHandle:
        check_start(self.name, self._closed, host, self.hosts(), spec)
        return await self._start(host, ReplicaSpec(list(spec.argv), dict(spec.env), spec.label))

    async def aclose(self) -> None:
        """Stop every process still running on a live host."""
        self._closed = True
        with anyio.move_on_after(2 * _STOP_SLACK_S):
            async with anyio.create_task_group() as tg:
                for handle in list(self._handles.values()):
                    tg.start_soon(self._stop_quietly, handle, 1.0)

    # --- replicas ----------------------------------------------------------------

    async def addresses(self, host: HostId, count: int) -> list[str]:
        """``count`` ``tcp://IP:PORT`` addresses free on ``host`` (its agent picks them)."""
        reply = await self._directory.call(host, lambda rid: PortsRequest(rid, count))
        if not isinstance(reply, PortsGranted) or len(reply.ports) != count:
            raise BackendError(f"host {host} gave no ports: {_describe(reply)}")
        return [f"tcp://{reply.ip}:{p}" for p in reply.ports]

    async def start_replica(
        self,
        host: HostId,
        spec: ProcessSpec,
        *,
        workdir: str,
        connection_key: str,
        owner: ReplicaOwner | None = None,
    ) -> AgentProcessHandle:
        """Start a Jupyter kernel replica: ``{workdir}`` in its argv names a directory on
        ``host``, holding a connection file seeded with ``host``'s address and the key;
        its agent keeps ``owner`` and the spec (:meth:`strays` reports them)."""
        check_start(self.name, self._closed, host, self.hosts(), spec)
        wire = ReplicaSpec(
            list(spec.argv), dict(spec.env), spec.label, workdir, connection_key, owner
        )
        return await self._start(host, wire)

    async def connection_info(self, handle: ProcessHandle, timeout: float) -> Mapping[str, Any]:
        """The replica's connection info once its kernel wrote its ports.

        Raises :class:`BackendError` if it ended first or ``timeout`` passed.
        """
        if not isinstance(handle, AgentProcessHandle):
            raise BackendError(f"{handle!r} is not a process of an agent")
        with anyio.move_on_after(timeout):
            while handle.returncode is None:
                reply = await self._request(
                    handle, lambda rid: ReplicaConnectionRequest(rid, handle.replica_id)
                )
                if isinstance(reply, ReplicaConnection) and reply.info:
                    return reply.info
                await anyio.sleep(_CONNECTION_POLL_S)
            raise BackendError(f"replica exited with status {handle.returncode} at start")
        raise BackendError(f"replica {handle.replica_id} gave no connection within {timeout} s")

    def process_id(self, handle: ProcessHandle) -> str:
        """The agent's id of ``handle``'s replica: what :meth:`adopt` takes back."""
        if not isinstance(handle, AgentProcessHandle):
            raise BackendError(f"{handle!r} is not a process of an agent")
        return handle.replica_id

    async def adopt(self, host: HostId, replica_id: str, timeout: float) -> AgentProcessHandle:
        """A handle on replica ``replica_id`` of ``host``, started by an earlier gateway.

        Waits up to ``timeout`` for the host to register, then asks its agent. The
        handle has ended already when the replica did (with its status, or
        :data:`UNKNOWN_STATUS` once forgotten). One whose host did not register in time
        is suspected: its host's registration tells whether it still runs.
        """
        handle = self._handles[replica_id] = AgentProcessHandle(self, host, replica_id)
        if not await self._directory.wait_live(host, timeout):
            log.warning("replica %s: host %s did not register yet; suspected", replica_id, host)
            handle.suspected = True
            return handle
        try:
            reply = await self._request(handle, ReplicaListRequest)
        except HostUnreachableError as exc:
            log.warning("replica %s: %s; suspected", replica_id, exc)
            handle.suspected = True
            return handle
        if isinstance(reply, ReplicaList):
            info = next((r for r in reply.replicas if r.replica_id == replica_id), None)
            if info is None:
                self._forget(handle, UNKNOWN_STATUS)
            elif not info.running:
                self._exited(handle, info)
            else:
                handle.pid = info.pid
        return handle

    async def strays(self) -> list[Stray]:
        """The running replicas of live hosts that no handle names, each with its spec
        and connection info: after a restart, an earlier gateway's that this one did not
        take back from its state (:mod:`nbos.gateway._strays` decides what becomes of them)."""
        found: list[Stray] = []
        for host in self.hosts():
            try:
                reply = await self._directory.call(
                    host, lambda rid: ReplicaListRequest(rid, with_specs=True)
                )
            except HostUnreachableError:
                continue
            if not isinstance(reply, ReplicaList):
                continue
            for info in reply.replicas:
                if info.running and info.replica_id not in self._handles:
                    found.append(Stray(host, info, await self._stray_connection(host, info)))
        return found

    def stop_stray(self, stray: Stray) -> None:
        """Stop ``stray`` (in the background)."""
        self._tg.start_soon(self._stop_retired, stray.host, stray.info.replica_id)

    async def _stray_connection(self, host: HostId, info: ReplicaInfo) -> dict[str, str | int]:
        if info.spec is None or not info.spec.connection_key:
            return {}
        try:
            reply = await self._directory.call(
                host, lambda rid: ReplicaConnectionRequest(rid, info.replica_id)
            )
        except HostUnreachableError:
            return {}
        return reply.info if isinstance(reply, ReplicaConnection) else {}

    # --- HostListener ------------------------------------------------------------

    def host_registered(self, host: RegisteredHost, replicas: list[ReplicaInfo]) -> None:
        """The host's agent said which replicas it has: the proof of what ended."""
        reported = {info.replica_id: info for info in replicas}
        for info in replicas:
            handle = self._handles.get(info.replica_id)
            if info.running and self._retired.get(info.replica_id) == host.host_id:
                log.warning(
                    "host %s is back with replica %s, which was stopped meanwhile: stopping it",
                    host.host_id,
                    info.replica_id,
                )
                self._tg.start_soon(self._stop_retired, host.host_id, info.replica_id)
            elif handle is not None and not info.running:
                self._exited(handle, info)
        for handle in [h for h in self._handles.values() if h.host == host.host_id]:
            if handle.replica_id not in reported:
                # Its agent does not know it (the agent keeps its replicas across its restarts).
                self._forget(handle, UNKNOWN_STATUS)
            elif handle.suspected:
                log.info("replica %s is back with host %s", handle.replica_id, host.host_id)
                handle.suspected = False

    def host_suspected(self, host: RegisteredHost) -> None:
        for handle in self._handles.values():
            if handle.host == host.host_id and not handle.suspected:
                log.warning(
                    "replica %s is suspected with host %s: it runs on as far as we know",
                    handle.replica_id,
                    host.host_id,
                )
                handle.suspected = True

    def replica_exited(self, host: HostId, replica: ReplicaInfo) -> None:
        handle = self._handles.get(replica.replica_id)
        if handle is not None and handle.host == host:
            self._exited(handle, replica)
        self._retired.pop(replica.replica_id, None)

    # --- internals ---------------------------------------------------------------

    async def _start(self, host: HostId, spec: ReplicaSpec) -> AgentProcessHandle:
        replica_id = uuid.uuid4().hex
        handle = self._handles[replica_id] = AgentProcessHandle(self, host, replica_id)
        try:
            reply = await self._directory.call(
                host, lambda rid: ReplicaStart(rid, replica_id, spec), timeout=_START_TIMEOUT_S
            )
        except BaseException:
            # The agent may have started it before we gave up (or start it yet, from a
            # request it holds): it was never acknowledged to anyone, so it must not live on.
            self._handles.pop(replica_id, None)
            self._tg.start_soon(self._stop_retired, host, replica_id)
            raise
        if not isinstance(reply, ReplicaState):
            self._handles.pop(replica_id, None)
            raise BackendError(f"host {host} did not start {spec.label!r}: {_describe(reply)}")
        handle.pid = reply.replica.pid
        if not reply.replica.running:
            self._exited(handle, reply.replica)
        log.info("started %r on %s as %s (pid %d)", spec.label, host, replica_id, handle.pid)
        return handle

    async def _request(
        self,
        handle: AgentProcessHandle,
        make: Callable[[int], ReplicaRequest],
        timeout: float | None = None,
    ) -> ReplicaReply | None:
        """A request about ``handle``'s process; :class:`HostUnreachableError` if its
        host did not answer (which proves nothing about the process)."""
        reply = await self._directory.call(handle.host, make, timeout)
        if isinstance(reply, ReplicaState) and not reply.replica.running:
            self._exited(handle, reply.replica)
        elif isinstance(reply, AgentError) and reply.kind == "unknown_replica":
            # Its end was reported and acknowledged already.
            self._forget(handle, UNKNOWN_STATUS)
        elif isinstance(reply, AgentError):
            raise BackendError(f"host {handle.host}: {reply.message}")
        return reply

    def _exited(self, handle: AgentProcessHandle, info: ReplicaInfo) -> None:
        if info.exit_code is not None:
            status = info.exit_code
        elif info.signal is not None:
            status = -info.signal
        else:
            status = UNKNOWN_STATUS
        self._forget(handle, status)

    def _retire(self, handle: AgentProcessHandle, why: str) -> None:
        """``handle`` was asked to stop but its host is unreachable: stopped when back."""
        log.warning("replica %s: %s; it is stopped when its host is back", handle.replica_id, why)
        self._forget(handle, HOST_LOST_STATUS)
        self._tg.start_soon(self._stop_retired, handle.host, handle.replica_id)

    def _forget(self, handle: AgentProcessHandle, status: int) -> None:
        self._handles.pop(handle.replica_id, None)
        handle._end(status)

    async def _stop_quietly(self, handle: AgentProcessHandle, grace: float) -> None:
        try:
            await handle.terminate(grace)
        except BackendError as exc:
            log.warning("could not stop replica %s: %s", handle.replica_id, exc)

    async def _stop_retired(self, host: HostId, replica_id: str) -> None:
        """Stop a replica nobody may use any more; retried while its host is known, since a
        host that was only slow never registers again to remind us."""
        self._retired[replica_id] = host
        backoff = _RETIRE_RETRY_S
        while self._retired.get(replica_id) == host and not self._closed:
            try:
                await self._directory.call(
                    host,
                    lambda rid: ReplicaStop(rid, replica_id, 1.0),
                    timeout=1.0 + _STOP_SLACK_S,
                )
            except HostUnreachableError as exc:
                if host not in {h.host_id for h in self._directory.hosts()}:
                    return  # removed from the cluster: its registration, if ever, stops it
                log.info("replica %s on %s not stopped yet: %s", replica_id, host, exc)
                await anyio.sleep(backoff)
                backoff = min(2 * backoff, _RETIRE_RETRY_MAX_S)
            else:
                # Stopped, or its agent does not know it (ended and reported already).
                self._retired.pop(replica_id, None)


def _describe(reply: ReplicaReply) -> str:
    if isinstance(reply, AgentError):
        return f"{reply.kind}: {reply.message}"
    return type(reply).__name__
