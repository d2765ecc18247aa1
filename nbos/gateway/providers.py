"""Host providers by name (entry point group ``nbos.host_providers``), and the built-in ones.

Each built-in provider runs a host's ``nbos agent`` as a process of a compute backend
(:mod:`nbos.backends`), so a host comes and goes with that process:

* ``local`` (:class:`LocalHostProvider`): virtual hosts on this machine, ``host-1``,
  ``host-2`` ..., each agent a local process with virtual GPUs (the embedded cluster's
  and the tests');
* ``docker`` (:class:`DockerHostProvider`): an agent container on one of the Docker
  engines given (the one running the fewest), from an image with nbos installed;
* ``ssh`` (:class:`SshHostProvider`): a standby pool of machines listed in the settings,
  each reached over SSH; a host is a pool machine not in use, named as in the pool.

One does not start agents itself: ``swarm`` (:class:`SwarmHostProvider`) makes a standby
node of a Docker Swarm active, and Swarm starts the agent service's task there.

A user's package registers its own (a cloud API) the same way: see
``examples/host_provider`` and ``docs/deploy.md``.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import attrs
import msgspec

from nbos.agent import ProcessIdentity
from nbos.core.compute_backend import ComputeBackend, ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError, ConfigError
from nbos.core.host_provider import AgentCommand, HostProvider
from nbos.core.ids import HostId
from nbos.core.plugins import PluginGroup
from nbos.transport.keys import check_host_name

log = logging.getLogger(__name__)

GROUP = "nbos.host_providers"
_PROVIDERS = PluginGroup[HostProvider](GROUP, HostProvider)

#: The engine of the machine the gateway runs on (a swarm manager's, for ``swarm``).
DEFAULT_ENGINE = "unix:///var/run/docker.sock"
#: How long an agent may take to stop its replicas on SIGTERM before it is killed.
AGENT_STOP_S = 15.0


def available_providers() -> list[str]:
    """Names of the registered host providers, sorted."""
    return _PROVIDERS.names()


def load_host_provider(name: str, /, **options: Any) -> HostProvider:
    """The provider registered as ``name``, made with ``options``.

    Raises :class:`~nbos.core.errors.PluginError` for an unknown name, a name two
    packages register, an entry point that cannot be imported (a missing optional
    dependency), options the factory refuses or a factory that does not make a
    ``HostProvider``; a ``ConfigError`` the factory raises for an option's value
    passes as it is.
    """
    return _PROVIDERS.make(name, **options)


class _Stoppable(Protocol):
    async def terminate(self, grace: float = ...) -> int: ...


@attrs.define
class _Agent:
    handle: _Stoppable
    #: The backend serving only this host (closed with it), or None for a shared one.
    own: ComputeBackend | None


class _AgentProcesses:
    """What the built-ins share: one agent process per host, stopped with SIGTERM."""

    def __init__(self) -> None:
        self._agents: dict[HostId, _Agent] = {}

    def hosts(self) -> Sequence[HostId]:
        """The hosts this provider added and has not removed."""
        return tuple(self._agents)

    async def _start(
        self,
        backend: ComputeBackend,
        where: HostId,
        host_id: HostId,
        argv: list[str],
        *,
        own: bool = False,
    ) -> ProcessHandle:
        handle = await backend.start(where, ProcessSpec(argv, label=f"agent-{host_id}"))
        self._agents[host_id] = _Agent(handle, backend if own else None)
        log.info("host %s: agent started (%r)", host_id, handle)
        return handle

    async def remove_host(self, host_id: HostId) -> None:
        agent = self._agents.pop(host_id, None)
        if agent is None:
            log.info("host %s was not added by this provider: nothing to stop", host_id)
            return
        status = await agent.handle.terminate(grace=AGENT_STOP_S)
        log.info("host %s: agent stopped (status %d)", host_id, status)
        if agent.own is not None:
            await agent.own.aclose()

    async def aclose(self) -> None:
        """Stop every agent, all at once (each may take its replicas' grace to stop)."""
        async with anyio.create_task_group() as tg:
            for host_id in list(self._agents):
                tg.start_soon(self._stop_quietly, host_id)

    async def _stop_quietly(self, host_id: HostId) -> None:
        try:
            await self.remove_host(host_id)
        except BackendError as exc:
            log.warning("host %s: agent not stopped: %s", host_id, exc)


class LocalHostProvider(_AgentProcesses):
    """Virtual hosts on this machine: ``{prefix}1``, ``{prefix}2`` ..., one agent process each.

    Each agent keeps its state and log under ``AgentCommand.data_dir``/``agents``. It
    runs in a session of its own (a signal to the gateway's process group, or the
    gateway's death, leaves it running) and is recorded in ``agents/HOST.pid``: one
    still running from an earlier gateway on the same data dir is used again.
    """

    def __init__(self, prefix: str = "host-", python: str = sys.executable) -> None:
        super().__init__()
        self._prefix = prefix
        self._python = python
        self._numbers = itertools.count(1)
        self._records: dict[HostId, Path] = {}

    @property
    def name(self) -> str:
        return "local"

    async def add_host(self, agent: AgentCommand) -> HostId:
        from nbos.backends.local import LocalProcessBackend, LocalProcessHandle

        host_id = HostId(f"{self._prefix}{next(self._numbers)}")
        root = Path(agent.data_dir or ".") / "agents"
        record = root / f"{host_id}.pid"
        pidfd = await anyio.to_thread.run_sync(_running_agent, record)
        if pidfd is not None:
            log.info("local agent of %s still runs from an earlier gateway: used again", host_id)
            self._agents[host_id] = _Agent(_AdoptedAgent(pidfd), None)
            return host_id
        backend = LocalProcessBackend([host_id], run_dir=root / "logs")
        argv = agent.argv(
            host_id,
            "127.0.0.1:0",
            str(root / host_id),
            self._python,
            virtual=True,
            settings=agent.settings,
        )
        handle = await self._start(backend, host_id, host_id, argv, own=True)
        assert isinstance(handle, LocalProcessHandle)  # what a LocalProcessBackend starts
        identity = ProcessIdentity.of(handle.pid)
        await anyio.Path(record).write_bytes(msgspec.json.encode(identity))
        self._records[host_id] = record
        return host_id

    async def remove_host(self, host_id: HostId) -> None:
        await super().remove_host(host_id)
        record = self._records.pop(host_id, None)
        if record is not None:
            await anyio.Path(record).unlink(missing_ok=True)


def _running_agent(record: Path) -> int | None:
    """A pidfd on the agent ``record`` names, if that process still runs."""
    try:
        identity = msgspec.json.decode(record.read_bytes(), type=ProcessIdentity)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("agent record %s unreadable, ignored: %s", record, exc)
        return None
    return identity.open()


@attrs.define
class _AdoptedAgent:
    """An agent an earlier gateway started: not our child, its pidfd tells its end."""

    pidfd: int

    async def terminate(self, grace: float = AGENT_STOP_S) -> int:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
            with anyio.move_on_after(grace) as scope:
                await anyio.wait_readable(self.pidfd)
            if scope.cancelled_caught:
                log.warning("local agent (pidfd %d) ignored SIGTERM: SIGKILL", self.pidfd)
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                await anyio.wait_readable(self.pidfd)
        except ProcessLookupError:
            pass  # it ended already
        finally:
            os.close(self.pidfd)
        return 0  # its exit status is its parent's (init's) to read


class DockerHostProvider(_AgentProcesses):
    """An agent container per host, on whichever of ``engines`` runs the fewest.

    ``engines`` maps names to Docker engine URLs; ``image`` has nbos installed (run
    with ``python``); containers use the host network, so ``ip`` is the engine
    machine's address agents are reached at. Hosts are named ``{prefix}N``.
    ``mounts`` (``SRC:DST``) are passed on (the key directory, a shared store);
    ``virtual_gpus``: agents get ``[cluster] gpus_per_host`` virtual GPUs, not NVML's.
    """

    def __init__(
        self,
        engines: Mapping[str, str],
        image: str,
        *,
        ip: str = "127.0.0.1",
        prefix: str = "docker-",
        python: str = "python",
        state_dir: str = "/tmp/nbos-agent",
        mounts: Sequence[str] = (),
        virtual_gpus: bool = False,
    ) -> None:
        from nbos.backends.docker import DockerBackend

        super().__init__()
        self._backend = DockerBackend(engines, image=image, mounts=mounts)
        self._where: dict[HostId, HostId] = {}
        self._ip, self._prefix, self._python, self._state = ip, prefix, python, state_dir
        self._virtual = virtual_gpus
        self._numbers = itertools.count(1)

    @property
    def name(self) -> str:
        return "docker"

    async def add_host(self, agent: AgentCommand) -> HostId:
        engines = self._backend.hosts()
        engine = min(engines, key=lambda e: sum(w == e for w in self._where.values()))
        host_id = HostId(f"{self._prefix}{next(self._numbers)}")
        state = f"{self._state}/{host_id}"
        argv = agent.argv(host_id, f"{self._ip}:0", state, self._python, virtual=self._virtual)
        await self._start(self._backend, engine, host_id, argv)
        self._where[host_id] = engine
        return host_id

    async def remove_host(self, host_id: HostId) -> None:
        self._where.pop(host_id, None)
        await super().remove_host(host_id)

    async def aclose(self) -> None:
        await super().aclose()
        await self._backend.aclose()


class SshHostProvider(_AgentProcesses):
    """A standby pool: ``hosts`` maps host names to SSH targets (``nbos.backends.SshHost``
    fields: ``address``, ``port``, ``user``, ``key_file``, ``known_hosts``); a host is
    added by starting its agent there (``python -m nbos agent``, listening on its
    ``address``), in pool order, and is free again once removed. ``virtual_gpus`` as
    for ``docker``."""

    def __init__(
        self,
        hosts: Mapping[str, Mapping[str, Any]],
        *,
        python: str = "python3",
        state_dir: str = ".nbos/agent",
        virtual_gpus: bool = False,
    ) -> None:
        from nbos.backends.ssh import SshBackend

        super().__init__()
        self._backend = SshBackend(hosts)
        self._addresses = {HostId(h): str(t["address"]) for h, t in hosts.items()}
        self._python, self._state, self._virtual = python, state_dir, virtual_gpus

    @property
    def name(self) -> str:
        return "ssh"

    async def add_host(self, agent: AgentCommand) -> HostId:
        free = [h for h in self._backend.hosts() if h not in self.hosts()]
        if not free:
            raise BackendError(
                f"every host of the ssh standby pool is in use ({len(self._addresses)})"
            )
        host_id = free[0]
        address = f"{self._addresses[host_id]}:0"
        state = f"{self._state}/{host_id}"
        argv = agent.argv(host_id, address, state, self._python, virtual=self._virtual)
        await self._start(self._backend, host_id, host_id, argv)
        return host_id

    async def aclose(self) -> None:
        await super().aclose()
        await self._backend.aclose()


class SwarmHostProvider:
    """Standby nodes of a Docker Swarm: nodes labelled ``label`` whose availability is
    ``drain``, through the manager's engine at ``engine``.

    ``add_host`` makes the first standby node (by hostname, ``ready`` ones only) active:
    Swarm then starts the agent's global service task there, which registers with the
    node's hostname as its host id, returned here. ``remove_host`` drains the node again
    (the gateway moved its replicas off first), and Swarm stops that agent. ``aclose``
    (the gateway shutting everything down) drains the nodes this provider made active.
    """

    def __init__(
        self, engine: str = "unix:///var/run/docker.sock", label: str = "nbos.gpu"
    ) -> None:
        from nbos.backends.swarm import SwarmNodes

        if not label:
            raise ConfigError("label", label, "the node label of the agent service's nodes")
        self._nodes = SwarmNodes(engine)
        self._label = label
        self._added: list[HostId] = []

    @property
    def name(self) -> str:
        return "swarm"

    async def add_host(self, agent: AgentCommand) -> HostId:
        nodes = await self._nodes.labelled(self._label)
        standby = [n for n in nodes if n.availability == "drain" and n.state == "ready"]
        if not standby:
            raise BackendError(
                f"no standby swarm node: none of the {len(nodes)} nodes labelled "
                f"{self._label} is ready with availability drain"
            )
        node = standby[0]
        host_id = HostId(check_host_name(node.hostname))
        await self._nodes.set_availability(node, "active")
        self._added.append(host_id)
        return host_id

    async def remove_host(self, host_id: HostId) -> None:
        node = await self._nodes.by_hostname(host_id, self._label)
        if host_id in self._added:
            self._added.remove(host_id)
        if node is None:
            log.info("host %s is no swarm node labelled %s: nothing to drain", host_id, self._label)
            return
        if node.availability != "drain":
            await self._nodes.set_availability(node, "drain")

    async def aclose(self) -> None:
        try:
            for host_id in list(self._added):
                try:
                    await self.remove_host(host_id)
                except BackendError as exc:
                    log.warning("swarm node %s not drained: %s", host_id, exc)
        finally:
            await self._nodes.aclose()
