"""Hosts reached over SSH (asyncssh): each process is a remote command in its own session.

The remote command is a small POSIX ``sh`` wrapper that makes sure the process
leads its own session and process group (OpenSSH already starts every session's
command with ``setsid``; elsewhere the wrapper calls ``setsid`` itself), prints
its PID (which is the process group id) on the channel, and ``exec``\\ s the
argv with stdin from ``/dev/null`` and stdout/stderr appended to a log file on
the remote host. Because of the ``exec`` chain the SSH server waits on the argv
process itself, so the exit status arrives as the channel's exit status, or as
its exit signal (reported as ``-N``, like ``subprocess``).

Signals go to the whole process group with ``kill -SIG -PGID`` over the same
connection. One connection per host carries every process there, with SSH
keepalives: when a host vanishes the connection closes after at most
``keepalive_interval * keepalive_count_max`` seconds (at once if the TCP
connection is reset), and ``wait`` raises
:class:`~nbos.core.errors.HostUnreachableError` instead of hanging. The remote
process's fate is then unknown; ``aclose`` cannot kill it and logs so.

Needs the ``ssh`` extra (``asyncssh``) and the asyncio event loop.
"""

from __future__ import annotations

import getpass
import itertools
import logging
import os
import shlex
import signal
from collections.abc import Mapping
from typing import Any

import anyio
import asyncssh
import attrs

from nbos.backends._common import (
    HandleBase,
    check_start,
    log_name,
    process_env,
    safe_file_part,
    with_running,
)
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError, ConfigError, HostUnreachableError
from nbos.core.ids import HostId

logger = logging.getLogger(__name__)

# $0 is this script, $1 the log file, the rest the argv. The first line makes the
# shell a process group leader (`kill -0 -PID` succeeds only for a group's id);
# setsid does not fork for a non-leader, so the PID stays the one sshd waits on. The
# umask keeps the log and whatever the process writes its owner's (private_files).
_WRAPPER = r"""kill -0 -$$ 2>/dev/null || exec setsid sh -c "$0" "$0" "$@"
umask 077
log=$1; shift
command -v "$1" >/dev/null 2>&1 || { echo "nbos: $1: command not found" >&2; exit 127; }
mkdir -p "${log%/*}" || exit 126
echo $$
exec "$@" </dev/null >>"$log" 2>&1"""


def _expand_user(path: str | None) -> str | None:
    return None if path is None else os.path.expanduser(path)


@attrs.frozen(kw_only=True)
class SshHost:
    """How to reach one host.

    ``user``: the login name (default: the local user). ``key_file``: a private key
    (default: asyncssh's defaults, ``~/.ssh/id_*`` and the agent). ``known_hosts``:
    the file to verify host keys against; ``None`` turns verification off (logged).
    """

    address: str
    port: int = 22
    user: str | None = None
    key_file: str | None = attrs.field(default=None, converter=_expand_user)
    known_hosts: str | None = attrs.field(default="~/.ssh/known_hosts", converter=_expand_user)


class SshProcessHandle(HandleBase):
    """A remote process, the leader of its own process group on its host."""

    def __init__(
        self,
        host: HostId,
        connection: asyncssh.SSHClientConnection,
        process: asyncssh.SSHClientProcess[str],
        pid: int,
        log_path: str,
    ) -> None:
        super().__init__(host)
        self._connection = connection
        self._process = process
        #: The remote process id, which is also its process group id.
        self.pid = pid
        #: The log file on the remote host (relative paths are under the login directory).
        self.log_path = log_path

    def __repr__(self) -> str:
        return f"<SshProcessHandle host={self._host} pid={self.pid} rc={self.returncode}>"

    @property
    def returncode(self) -> int | None:
        """Exit status; ``-N`` when killed by signal ``N``; ``None`` while running or lost."""
        rc: int | None = self._process.returncode
        return rc

    @property
    def lost(self) -> bool:
        """The connection closed before the exit status arrived: the process's fate is unknown."""
        return self._process.is_closing() and self.returncode is None

    async def wait(self) -> int:
        """The exit status; raises :class:`HostUnreachableError` if the connection is lost."""
        await self._process.wait_closed()
        rc = self.returncode
        if rc is None:
            logger.warning("lost %s while pid %d ran there", self._host, self.pid)
            raise HostUnreachableError(self._host, f"connection lost while pid {self.pid} ran")
        return rc

    async def signal(self, signum: int) -> None:
        """``kill -SIG -PGID`` on the host; a no-op once the process ended."""
        if self.returncode is not None:
            return
        if self.lost:
            raise HostUnreachableError(self._host, "connection lost")
        await _remote_kill(self._host, self._connection, self.pid, signum)


class SshBackend:
    """Starts processes on hosts over SSH.

    ``hosts`` maps host ids to :class:`SshHost` (or mappings of its fields, as read
    from a config file). ``remote_log_dir`` is where logs go on each host (a relative
    or ``~/`` path is under the login directory); each host's logs are in a subdirectory named
    after its host id.
    """

    def __init__(
        self,
        hosts: Mapping[str, SshHost | Mapping[str, Any]],
        *,
        remote_log_dir: str = ".nbos/logs",
        connect_timeout: float = 10.0,
        keepalive_interval: float = 2.0,
        keepalive_count_max: int = 3,
    ) -> None:
        if not hosts:
            raise ConfigError("hosts", hosts, "a non-empty mapping of host id to SSH host")
        self._targets = {HostId(h): _as_ssh_host(h, t) for h, t in hosts.items()}
        # The path is quoted on the command line, so "~/" would not expand: make it relative.
        self._remote_log_dir = remote_log_dir.removeprefix("~/").rstrip("/") or "/"
        self._connect_timeout = connect_timeout
        self._keepalive = (keepalive_interval, keepalive_count_max)
        self._connections: dict[HostId, asyncssh.SSHClientConnection] = {}
        self._connect_locks = {h: anyio.Lock() for h in self._targets}
        self._handles: list[SshProcessHandle] = []
        self._seq = itertools.count()
        self._closed = False

    @property
    def name(self) -> str:
        return "ssh"

    def hosts(self) -> tuple[HostId, ...]:
        return tuple(self._targets)

    async def start(self, host: HostId, spec: ProcessSpec) -> SshProcessHandle:
        check_start(self.name, self._closed, host, self._targets, spec)
        log_path = (
            f"{self._remote_log_dir}/{safe_file_part(host)}/{log_name(next(self._seq), spec)}"
        )
        connection, process = await self._create_process(host, _command(host, spec, log_path))
        try:
            pid = await _read_pid(host, spec, process)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _abandon(host, connection, process)
            raise
        handle = SshProcessHandle(host, connection, process, pid, log_path)
        self._handles = with_running(self._handles, handle)
        logger.debug("started %r on %s: pid %d, log %s", spec.label, host, pid, log_path)
        return handle

    async def run(self, host: HostId, command: str, *, stdin: str | None = None) -> str:
        """Run a short shell ``command`` on ``host`` (with ``stdin``); its output.

        Raises :class:`BackendError` when it exits non-zero (quoting its stderr) and
        :class:`HostUnreachableError` when the host cannot be reached.
        """
        check_start(self.name, self._closed, host, self._targets, ProcessSpec(["sh"]))
        connection = await self._connection(host)
        try:
            with anyio.fail_after(self._connect_timeout):
                result = await connection.run(command, input=stdin, check=False)
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            raise HostUnreachableError(host, f"running a command: {exc}") from exc
        if result.exit_status != 0:
            error = str(result.stderr).strip()[-500:]
            logger.warning("%s: %r failed (%s): %s", host, command[:80], result.exit_status, error)
            raise BackendError(f"{host}: command failed ({result.exit_status}): {error}")
        return str(result.stdout)

    async def detach(self) -> None:
        """Close the connections and leave every process running: it outlives this backend
        (its output goes to its log file), and ending it is the caller's business."""
        self._closed = True
        self._handles.clear()
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    async def aclose(self) -> None:
        """SIGKILL every process group still running, then close the connections."""
        self._closed = True
        for handle in self._handles:
            if handle.lost:
                logger.warning("cannot kill pid %d on %s: connection lost", handle.pid, handle.host)
            elif handle.returncode is None:
                await self._kill(handle)
        self._handles.clear()
        for connection in self._connections.values():
            connection.close()
        with anyio.move_on_after(self._connect_timeout):
            for connection in self._connections.values():
                await connection.wait_closed()
        self._connections.clear()

    async def _kill(self, handle: SshProcessHandle) -> None:
        try:
            with anyio.move_on_after(self._connect_timeout):
                await handle.signal(signal.SIGKILL)
                await handle.wait()
        except HostUnreachableError as exc:
            logger.warning("cannot kill pid %d on %s: %s", handle.pid, handle.host, exc)

    async def _create_process(
        self, host: HostId, command: str
    ) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess[str]]:
        # A connection found dead only now (the host restarted sshd, say) gets one retry.
        retried = False
        while True:
            connection = await self._connection(host)
            try:
                return connection, await self._open_session(host, connection, command)
            except (OSError, asyncssh.Error) as exc:
                if not connection.is_closed():
                    logger.warning("%s refused a session: %s", host, exc)
                    raise BackendError(f"{host} refused an SSH session: {exc}") from exc
                if retried:
                    raise HostUnreachableError(host, f"connection lost: {exc}") from exc
                retried = True
                logger.info("connection to %s was lost; reconnecting", host)

    async def _open_session(
        self, host: HostId, connection: asyncssh.SSHClientConnection, command: str
    ) -> asyncssh.SSHClientProcess[str]:
        # Shielded: once the exec request is out the command may run, and only the
        # process object lets a cancelled start find and kill it (start's next await).
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._connect_timeout):
            process: asyncssh.SSHClientProcess[str] = await connection.create_process(command)
            return process
        raise HostUnreachableError(host, f"no SSH session within {self._connect_timeout}s")

    async def _connection(self, host: HostId) -> asyncssh.SSHClientConnection:
        async with self._connect_locks[host]:
            connection = self._connections.get(host)
            if connection is None or connection.is_closed():
                connection = await self._connect(host, self._targets[host])
                self._connections[host] = connection
            return connection

    async def _connect(self, host: HostId, target: SshHost) -> asyncssh.SSHClientConnection:
        if target.known_hosts is None:
            logger.warning("host key of %s is not verified (known_hosts=None)", host)
        try:
            return await asyncssh.connect(
                target.address,
                target.port,
                username=target.user or getpass.getuser(),
                client_keys=[target.key_file] if target.key_file else (),
                known_hosts=target.known_hosts,
                connect_timeout=self._connect_timeout,
                keepalive_interval=self._keepalive[0],
                keepalive_count_max=self._keepalive[1],
            )
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            logger.warning(
                "cannot connect to %s (%s:%d): %s", host, target.address, target.port, exc
            )
            raise HostUnreachableError(
                host, f"ssh to {target.address}:{target.port}: {exc}"
            ) from exc


def _as_ssh_host(host: str, target: SshHost | Mapping[str, Any]) -> SshHost:
    if isinstance(target, SshHost):
        return target
    try:
        return SshHost(**target)
    except TypeError as exc:
        raise ConfigError(f"hosts.{host}", target, f"the fields of SshHost ({exc})") from exc


def _command(host: HostId, spec: ProcessSpec, log_path: str) -> str:
    env = [f"{k}={v}" for k, v in process_env(host, spec.env).items()]
    words = ["exec", "env", *env, "sh", "-c", _WRAPPER, _WRAPPER, log_path, *spec.argv]
    return " ".join(shlex.quote(w) for w in words)


async def _read_pid(
    host: HostId, spec: ProcessSpec, process: asyncssh.SSHClientProcess[str]
) -> int:
    try:
        line = await process.stdout.readline()
        if line.strip().isdigit():
            return int(line)
        await process.wait_closed()
        error = (await process.stderr.read()).strip()[-500:]
    except (OSError, asyncssh.Error) as exc:
        raise HostUnreachableError(host, f"connection lost while starting: {exc}") from exc
    if process.returncode is None:
        raise HostUnreachableError(host, "connection lost while starting")
    logger.warning("cannot start %r on %s: %s", spec.argv[0], host, error)
    raise BackendError(
        f"cannot start {spec.argv[0]!r} on {host}: {error or f'exit status {process.returncode}'}"
    )


async def _abandon(
    host: HostId, connection: asyncssh.SSHClientConnection, process: asyncssh.SSHClientProcess[str]
) -> None:
    """Kill a process whose start was interrupted: its PID line arrives at once, if at all."""
    try:
        with anyio.move_on_after(5.0):
            line = await process.stdout.readline()
            if line.strip().isdigit():
                await _remote_kill(host, connection, int(line), signal.SIGKILL)
    except (OSError, asyncssh.Error, HostUnreachableError) as exc:
        logger.warning("an interrupted start on %s may have left a process: %s", host, exc)
    process.close()


async def _remote_kill(
    host: HostId, connection: asyncssh.SSHClientConnection, pgid: int, signum: int
) -> None:
    try:
        result = await connection.run(f"kill -{int(signum)} -{pgid}", check=False)
    except (OSError, asyncssh.Error) as exc:
        logger.warning("cannot signal pid %d on %s: %s", pgid, host, exc)
        raise HostUnreachableError(host, f"signal {signum} to pid {pgid}: {exc}") from exc
    if result.exit_status != 0:
        # Most often the group has just ended; the exit status tells the caller.
        logger.debug("kill -%d -%d on %s: %s", signum, pgid, host, result.stderr)
