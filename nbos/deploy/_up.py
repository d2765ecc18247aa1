"""``nbos cluster up|restart|down``: a cluster file's gateway and agents.

``up`` makes the CURVE keys (``nbos keys``: pairs that exist are kept), starts
the gateway as a local process, then every host's agent: a local process, a
remote command over SSH (its keys written there first) or a container on the
host's Docker engine (its keys put into the container before it starts). Each
process is recorded in ``RUN_DIR/cluster.json`` as soon as it runs (PID and
start time; remote PID; container id), so that ``down`` stops exactly those, and a
failed ``up`` stops what it started. ``up`` on a cluster that runs, in whole or in
part, keeps each recorded process that still runs and starts only the others (a
gateway started again takes its kernels back from its data dir). It returns once
the gateway reports every host ``up``.

``restart gateway`` stops the gateway with SIGTERM, which with its data dir leaves
every kernel running, and starts it again; ``restart HOST`` kills that host's agent
alone (its replicas run on) and starts it again, and the new agent adopts them.

``down`` asks the gateway to shut every kernel down (``ShutdownCluster``: the
gateway exits once they are), then stops the agents. They run with
``--stop-replicas-on-exit``: no replica is left behind, even of a gateway that no
longer ran.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from nbos.agent import process_start_ticks
from nbos.core.compute_backend import ProcessSpec
from nbos.core.config import Settings
from nbos.core.errors import BackendError, ConfigError, NbosError
from nbos.core.ids import HostId
from nbos.core.private_files import open_private
from nbos.deploy._file import ClusterFile, HostTable, StartKind, load_cluster_file
from nbos.gateway.control_api import (
    ClusterStatus,
    KernelList,
    ShutdownCluster,
    StatusRequest,
    call,
)
from nbos.transport.keys import GATEWAY_KEY, HOSTS_DIR, generate_keys

if TYPE_CHECKING:  # the backends' extras (asyncssh, aiodocker) are needed only where used
    from nbos.backends.docker import DockerBackend
    from nbos.backends.ssh import SshBackend

log = logging.getLogger(__name__)

RECORD = "cluster.json"
#: Where an agent keeps its state and keys when its host names no ``dir``: under the
#: login directory over SSH, in the container with Docker (local: ``RUN_DIR/NAME``).
SSH_DIR = ".nbos/agent"
DOCKER_DIR = "/var/lib/nbos/agent"
_STOP_GRACE_S = 30.0
#: How long shutting every kernel down may take (each has its replicas' grace, all at once).
_SHUTDOWN_TIMEOUT_S = 120.0
#: How long a gateway that nobody recorded has to answer before up starts its own.
_STRANGER_TIMEOUT_S = 2.0
#: How long a gateway started again (chaos) may take to answer: it takes its kernels back.
_ANSWER_TIMEOUT_S = 120.0
_POLL_S = 0.3


class Started(msgspec.Struct, forbid_unknown_fields=True):
    """One process ``up`` started: where, and what ``down`` needs to stop it."""

    host: str
    start: StartKind
    pid: int = 0
    start_ticks: int | None = None
    container: str = ""


class Deployment(msgspec.Struct, forbid_unknown_fields=True):
    """``RUN_DIR/cluster.json``: the gateway and agents ``up`` started."""

    gateway: Started | None = None
    agents: list[Started] = msgspec.field(default_factory=list)


class Cluster:
    """One cluster file and its run directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()
        self.file: ClusterFile = load_cluster_file(self.path)
        self.base = self.path.parent
        self.run_dir = self.file.run_dir(self.base)
        self.keys = self.file.keys_dir(self.base)

    def record(self) -> Deployment:
        try:
            return msgspec.json.decode((self.run_dir / RECORD).read_bytes(), type=Deployment)
        except FileNotFoundError:
            return Deployment()
        except (OSError, msgspec.DecodeError) as exc:
            raise ConfigError(
                str(self.run_dir / RECORD), None, f"a readable record ({exc})"
            ) from exc

    def save(self, deployment: Deployment) -> None:
        path = self.run_dir / RECORD
        scratch = path.with_suffix(".tmp")
        scratch.write_bytes(msgspec.json.encode(deployment))
        os.replace(scratch, path)

    def gateway_env(self) -> dict[str, str]:
        """The gateway's settings as ``NBOS_*`` variables (checked as ``nbos gateway`` will)."""
        env = {
            f"NBOS_{section.upper()}__{key.upper()}": str(value).lower()
            if isinstance(value, bool)
            else str(value)
            for section, values in self.file.gateway_settings(self.base, self.run_dir).items()
            for key, value in values.items()
        }
        Settings.load(env=env)
        return env


async def cluster_up(path: str | os.PathLike[str], timeout: float) -> ClusterStatus:
    """Start what of the cluster at ``path`` does not run (all of it the first time);
    its status once every host is up. What an earlier ``up`` started and still runs is
    kept: a cluster is never started twice over the same state."""
    cluster = Cluster(path)
    cluster.run_dir.mkdir(parents=True, exist_ok=True)
    generate_keys(cluster.keys, [h.name for h in cluster.file.hosts])
    deployment = cluster.record()
    fresh = Deployment()  # what this call starts, stopped again if it fails
    try:
        if _running(deployment.gateway):
            assert deployment.gateway is not None
            log.info("gateway runs already (pid %d): kept", deployment.gateway.pid)
        else:
            await _refuse_unrecorded_gateway(cluster)
            deployment.gateway = fresh.gateway = _start_gateway(cluster)
            cluster.save(deployment)
        for host in cluster.file.hosts:
            recorded = _recorded_agent(deployment, host.name)
            if recorded is not None and await _agent_runs(cluster, host, recorded):
                log.info("agent of %s runs already: kept", host.name)
                continue
            if recorded is not None:  # ended: what is left of it (a container) goes
                await _stop_agent(cluster, host, recorded)
                deployment.agents.remove(recorded)
            started = await _start_agent(cluster, host)
            deployment.agents.append(started)
            fresh.agents.append(started)
            cluster.save(deployment)
        return await _wait_up(cluster, deployment, timeout)
    except BaseException:
        log.warning("cluster up failed: stopping what it started")
        with anyio.CancelScope(shield=True):
            await _stop(cluster, deployment, fresh)
        raise


async def cluster_restart(
    path: str | os.PathLike[str], target: str, timeout: float
) -> ClusterStatus:
    """Restart the gateway (``target`` ``"gateway"``) or the agent of host ``target``;
    the status once every host is up again. Kernels run on through either."""
    cluster = Cluster(path)
    deployment = cluster.record()
    if target == "gateway":
        if deployment.gateway is not None:
            # SIGTERM: with its data dir the gateway leaves its kernels running.
            await _stop_local(deployment.gateway)
        deployment.gateway = _start_gateway(cluster)
    else:
        host = _host_table(cluster, target)
        recorded = _recorded_agent(deployment, target)
        if recorded is not None:
            # Alone and at once: a stop would take the replicas with it.
            await _kill_agent(host, recorded)
        started = await _start_agent(cluster, host)
        deployment.agents = [started if a is recorded else a for a in deployment.agents]
        if recorded is None:
            deployment.agents.append(started)
    cluster.save(deployment)
    return await _wait_up(cluster, deployment, timeout)


async def cluster_down(path: str | os.PathLike[str]) -> list[str]:
    """Shut every kernel of the cluster at ``path`` down, then stop what ``up`` started
    (gateway first); the names of what was stopped."""
    cluster = Cluster(path)
    deployment = cluster.record()
    names = ["gateway"] * (deployment.gateway is not None) + [a.host for a in deployment.agents]
    if deployment.gateway is not None:
        await _shut_down_kernels(cluster, deployment.gateway)
    await _stop(cluster, deployment, deployment)
    return names


class DeployedCluster:
    """The processes ``nbos cluster up FILE`` started, as ``nbos chaos --cluster FILE``
    strikes them (:class:`nbos.chaos.GatewayProcesses`): ``kill -9`` the gateway or a
    host's agent, and start it again as ``up`` did, the record kept current."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.cluster = Cluster(path)
        self.address = self.cluster.file.gateway.address
        if not _running(self.cluster.record().gateway):
            raise ConfigError(str(self.cluster.path), "down", "a cluster that is up")

    async def kill_gateway(self) -> None:
        deployment = self.cluster.record()
        assert deployment.gateway is not None  # up, as checked at the start
        await _kill_local(deployment.gateway)

    async def start_gateway(self) -> None:
        deployment = self.cluster.record()
        deployment.gateway = _start_gateway(self.cluster)
        self.cluster.save(deployment)
        await _wait_answers(self.address, deployment.gateway, self.cluster.run_dir)

    async def kill_agent(self, host: str) -> None:
        agent = _recorded_agent(self.cluster.record(), host)
        if agent is None:
            raise BackendError(f"no agent of {host} was started by cluster up")
        await _kill_agent(_host_table(self.cluster, host), agent)
        log.warning("agent of %s killed (chaos)", host)

    async def start_agent(self, host: str) -> None:
        deployment = self.cluster.record()
        started = await _start_agent(self.cluster, _host_table(self.cluster, host))
        deployment.agents = [a for a in deployment.agents if a.host != host] + [started]
        self.cluster.save(deployment)


def _recorded_agent(deployment: Deployment, host: str) -> Started | None:
    return next((a for a in deployment.agents if a.host == host), None)


def _host_table(cluster: Cluster, host: str) -> HostTable:
    table = next((h for h in cluster.file.hosts if h.name == host), None)
    if table is None:
        raise BackendError(f"host {host} is not in {cluster.path}")
    return table


async def _kill_agent(host: HostTable, agent: Started) -> None:
    """``kill -9`` the agent alone: its replicas run on, for the next agent to adopt."""
    if agent.start == "local":
        await _kill_local(agent, group=False)
    elif agent.start == "ssh":
        await _kill_ssh(host, agent.pid)
    else:  # the container's main process: its replicas would go with it
        raise BackendError(f"the agent of {host.name} runs in a container: not killed alone")


async def _kill_local(process: Started, *, group: bool = True) -> None:
    """``kill -9`` a recorded local process (its process group, or itself alone)."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            os.kill(process.pid, signal.SIGKILL)
    while _running(process):  # noqa: ASYNC110 (not our child: polled)
        await anyio.sleep(_POLL_S)


async def _kill_ssh(host: HostTable, pid: int) -> None:
    backend = _ssh_backend(host)
    try:
        await backend.run(HostId(host.name), f"kill -KILL {pid} 2>/dev/null; true")
    finally:
        await backend.detach()


async def _wait_answers(address: str, gateway: Started, run_dir: Path) -> None:
    """Return once the gateway at ``address`` answers a status request."""
    with anyio.move_on_after(_ANSWER_TIMEOUT_S):
        while True:
            if not _running(gateway):
                raise BackendError(f"the gateway ended; see {run_dir / 'gateway.log'}")
            with contextlib.suppress(NbosError):
                if isinstance(await call(address, StatusRequest(), timeout=5.0), ClusterStatus):
                    return
            await anyio.sleep(_POLL_S)
    raise BackendError(f"the gateway did not answer; see {run_dir / 'gateway.log'}")


# --- starting --------------------------------------------------------------------


def _start_gateway(cluster: Cluster) -> Started:
    argv = [sys.executable, "-m", "nbos", "--log-level", "INFO", "gateway"]
    started = _start_local("gateway", argv, cluster.gateway_env(), cluster.run_dir / "gateway.log")
    log.info("gateway started: pid %d", started.pid)
    return started


def _start_local(name: str, argv: Sequence[str], env: Mapping[str, str], log_file: Path) -> Started:
    """``argv`` in a session of its own (it outlives this command), output to ``log_file``."""
    with open_private(log_file) as out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    return Started(name, "local", process.pid, process_start_ticks(process.pid))


def _agent_argv(cluster: Cluster, host: HostTable, state: str, keys: str) -> list[str]:
    g = cluster.file.gateway
    argv = [*host.command, "--log-level", "INFO", "agent", "--host", host.name]
    argv += ["--address", f"{host.address}:{host.agent_port}", "--gateway", g.agent_address]
    argv += ["--state-dir", state, "--keys", keys, "--heartbeat", str(g.heartbeat_s)]
    if isinstance(host.gpus, int):
        argv += ["--gpus", str(host.gpus)]
    return [*argv, "--stop-replicas-on-exit"]


def _agent_keys(cluster: Cluster, host: str) -> dict[str, bytes]:
    """What the agent of ``host`` needs of the key directory, by relative path."""
    names = [f"{GATEWAY_KEY}.key", f"{HOSTS_DIR}/{host}.key_secret"]
    return {name: (cluster.keys / name).read_bytes() for name in names}


async def _start_agent(cluster: Cluster, host: HostTable) -> Started:
    spec_env = dict(host.env)
    if host.start == "local":
        state = cluster.base / host.dir / "state" if host.dir else cluster.run_dir / host.name
        argv = _agent_argv(cluster, host, str(state), str(cluster.keys))
        log_file = cluster.run_dir / f"agent-{host.name}.log"
        started = _start_local(host.name, argv, spec_env, log_file)
    elif host.start == "ssh":
        started = await _start_ssh_agent(cluster, host, spec_env)
    else:
        started = await _start_docker_agent(cluster, host, spec_env)
    log.info("agent of %s started (%s)", host.name, host.start)
    return started


async def _start_ssh_agent(cluster: Cluster, host: HostTable, env: dict[str, str]) -> Started:
    backend = _ssh_backend(host)
    try:
        keys = f"{host.dir or SSH_DIR}/keys"
        for name, data in _agent_keys(cluster, host.name).items():
            target = shlex.quote(f"{keys}/{name}")
            await backend.run(
                HostId(host.name),
                f'umask 077 && mkdir -p "$(dirname {target})" && cat > {target}',
                stdin=data.decode(),
            )
        argv = _agent_argv(cluster, host, f"{host.dir or SSH_DIR}/state", keys)
        handle = await backend.start(HostId(host.name), ProcessSpec(argv, env, "agent"))
        return Started(host.name, "ssh", handle.pid)
    finally:
        await backend.detach()


async def _start_docker_agent(cluster: Cluster, host: HostTable, env: dict[str, str]) -> Started:
    backend = _docker_backend(cluster, host)
    try:
        keys = f"{host.dir or DOCKER_DIR}/keys"
        files = {f"{keys}/{n}": data for n, data in _agent_keys(cluster, host.name).items()}
        argv = _agent_argv(cluster, host, f"{host.dir or DOCKER_DIR}/state", keys)
        spec = ProcessSpec(argv, env, "agent")
        handle = await backend.start(HostId(host.name), spec, files=files)
        return Started(host.name, "docker", container=handle.container_id)
    finally:
        await backend.detach()


def _ssh_backend(host: HostTable) -> SshBackend:
    from nbos.backends.ssh import SshBackend, SshHost

    assert host.ssh is not None  # checked when the file was read
    s = host.ssh
    target = SshHost(
        address=s.host or host.address,
        port=s.port,
        user=s.user or None,
        key_file=s.key_file or None,
        known_hosts=s.known_hosts or None,
    )
    return SshBackend({host.name: target}, remote_log_dir=f"{host.dir or SSH_DIR}/logs")


def _docker_backend(cluster: Cluster, host: HostTable) -> DockerBackend:
    from nbos.backends.docker import DockerBackend

    assert host.docker is not None  # checked when the file was read
    mounts = list(host.docker.mounts)
    store = cluster.file.store_path(cluster.base, cluster.run_dir)
    if store:  # the directory store, on this machine: the container sees it at the same path
        Path(store).mkdir(parents=True, exist_ok=True)
        mounts.append(f"{store}:{store}")
    return DockerBackend({host.name: host.docker.engine}, image=host.docker.image, mounts=mounts)


async def _wait_up(cluster: Cluster, deployment: Deployment, timeout: float) -> ClusterStatus:
    """Poll the gateway until every host of the file is ``up``."""
    names = {h.name for h in cluster.file.hosts}
    address = cluster.file.gateway.address
    assert deployment.gateway is not None
    status: ClusterStatus | None = None
    with anyio.move_on_after(timeout):
        while True:
            if not _running(deployment.gateway):
                raise BackendError(f"the gateway ended; see {cluster.run_dir / 'gateway.log'}")
            with contextlib.suppress(NbosError):
                reply = await call(address, StatusRequest(), timeout=5.0)
                if isinstance(reply, ClusterStatus):
                    status = reply
                    if names <= {h.host_id for h in reply.hosts if h.state == "up"}:
                        return reply
            await anyio.sleep(_POLL_S)
    up = {h.host_id for h in status.hosts if h.state == "up"} if status else set()
    raise BackendError(
        f"hosts {sorted(names - up)} did not come up within {timeout:g} s; "
        f"see the logs in {cluster.run_dir}"
    )


# --- stopping --------------------------------------------------------------------


async def _stop(cluster: Cluster, record: Deployment, stopping: Deployment) -> None:
    """Stop the gateway and the agents of ``stopping`` (the agents all at once), each
    taken out of ``record`` (saved) once it is stopped."""
    if stopping.gateway is not None:
        await _stop_local(stopping.gateway)
        record.gateway = None
        cluster.save(record)
    hosts = {h.name: h for h in cluster.file.hosts}

    async def stop(agent: Started) -> None:
        host = hosts.get(agent.host)
        if host is None and agent.start != "local":
            log.warning("agent of %s: no longer in the file; left as it is", agent.host)
            return
        await _stop_agent(cluster, host, agent)
        record.agents.remove(agent)
        cluster.save(record)

    async with anyio.create_task_group() as tg:
        for agent in list(stopping.agents):
            tg.start_soon(stop, agent)


async def _stop_agent(cluster: Cluster, host: HostTable | None, agent: Started) -> None:
    """SIGTERM the agent (it stops its replicas); a container is removed."""
    if agent.start == "local":
        await _stop_local(agent)
    elif agent.start == "ssh":
        assert host is not None  # its SSH table says how to reach it
        await _stop_ssh(host, agent.pid)
    else:
        assert host is not None
        await _stop_docker(cluster, host, agent.container)


async def _agent_runs(cluster: Cluster, host: HostTable, agent: Started) -> bool:
    """Whether the agent ``up`` recorded for ``host`` still runs there."""
    if agent.start == "local":
        return _running(agent)
    if agent.start == "ssh":
        backend = _ssh_backend(host)
        try:
            probe = f"kill -0 {agent.pid} 2>/dev/null && echo running; true"
            return bool(await backend.run(HostId(host.name), probe))
        finally:
            await backend.detach()
    docker = _docker_backend(cluster, host)
    try:
        handle = await docker.adopt(HostId(host.name), agent.container)
        return handle is not None and await handle.host_pid() != 0
    finally:
        await docker.detach()


async def _refuse_unrecorded_gateway(cluster: Cluster) -> None:
    """A gateway that answers at the file's address but that ``up`` did not start (or
    whose record was lost) would hold the ports: say so rather than start another."""
    address = cluster.file.gateway.address
    try:
        await call(address, StatusRequest(), timeout=_STRANGER_TIMEOUT_S)
    except NbosError:
        return  # nobody answers: the address is free for the gateway up starts
    raise ConfigError(
        str(cluster.path),
        "up",
        f"no gateway at {address} but the one {RECORD} names (one that it does not "
        "name answers there: stop it first)",
    )


async def _shut_down_kernels(cluster: Cluster, gateway: Started) -> None:
    """``ShutdownCluster``: every kernel shut down, then the gateway exits by itself."""
    if not _running(gateway):
        log.warning(
            "the gateway does not run: its kernels are not shut down (their replicas stop "
            "with the agents; its state in %s still names them)",
            cluster.run_dir / "gateway",
        )
        return
    address = cluster.file.gateway.address
    try:
        reply = await call(address, ShutdownCluster(), timeout=_SHUTDOWN_TIMEOUT_S)
    except NbosError as exc:
        log.warning("the gateway did not shut its kernels down: %s", exc)
        return
    if not isinstance(reply, KernelList):
        log.warning("the gateway did not shut its kernels down: %s", reply)
        return
    log.info("every kernel shut down; waiting for the gateway to exit")
    with anyio.move_on_after(_STOP_GRACE_S):
        while _running(gateway):  # noqa: ASYNC110 (not our child: polled)
            await anyio.sleep(_POLL_S)


async def _stop_local(process: Started) -> None:
    if not _running(process):
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        with anyio.move_on_after(_STOP_GRACE_S):
            while _running(process):  # noqa: ASYNC110 (not our child: polled)
                await anyio.sleep(_POLL_S)
            log.info("%s (pid %d) stopped", process.host, process.pid)
            return
        log.warning(
            "%s (pid %d) ignored SIGTERM for %.0f s", process.host, process.pid, _STOP_GRACE_S
        )


async def _stop_ssh(host: HostTable, pid: int) -> None:
    backend = _ssh_backend(host)
    name = HostId(host.name)
    try:
        await backend.run(name, f"kill -TERM -{pid} 2>/dev/null; true")
        deadline = time.monotonic() + _STOP_GRACE_S
        while time.monotonic() < deadline:
            if not await backend.run(name, f"kill -0 -{pid} 2>/dev/null && echo running; true"):
                return
            await anyio.sleep(_POLL_S)
        log.warning("agent of %s (pid %d) ignored SIGTERM: SIGKILL", host.name, pid)
        await backend.run(name, f"kill -KILL -{pid} 2>/dev/null; true")
    finally:
        await backend.detach()


async def _stop_docker(cluster: Cluster, host: HostTable, container: str) -> None:
    backend = _docker_backend(cluster, host)
    try:
        await backend.remove(HostId(host.name), container, grace=_STOP_GRACE_S)
    finally:
        await backend.detach()


def _running(process: Started | None) -> bool:
    """Whether the local process recorded is still the one that was started."""
    if process is None or process.start != "local":
        return False
    ticks = process_start_ticks(process.pid)
    return ticks is not None and ticks == process.start_ticks and not _zombie(process.pid)


def _zombie(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def _stat(pid: int) -> Sequence[str] | None:
    """``/proc/PID/stat`` from field 3 (state) on; the name may hold spaces and ')'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
