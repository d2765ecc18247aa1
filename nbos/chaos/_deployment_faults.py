"""Nemeses of a gateway deployment: kill the gateway or a host agent, cut a host off.

Each is given what carries its fault out: :class:`GatewayProcesses` (the processes of
a cluster that ``nbos cluster up`` started: :class:`nbos.deploy.DeployedCluster`) or a
:class:`Network` (commands of the user's that cut a host off and heal it:
:class:`CommandNetwork`). Without one, the nemesis is refused before anything runs.
"""

from __future__ import annotations

import logging
import random
import shlex
from typing import Protocol, TypeVar

import anyio
import attrs

from nbos.chaos._nemesis import Strike, described, executor_of
from nbos.chaos._target import Capability, ChaosKernel
from nbos.core.errors import ConfigError, KernelError, NemesisUnsupportedError

log = logging.getLogger(__name__)

T = TypeVar("T")


class GatewayProcesses(Protocol):
    """The gateway and agent processes of a deployment, to ``kill -9`` and start again."""

    async def kill_gateway(self) -> None: ...

    async def start_gateway(self) -> None:
        """Start the gateway again on its settings; return once it answers."""
        ...

    async def kill_agent(self, host: str) -> None:
        """``kill -9`` the agent of ``host`` (not its replicas)."""
        ...

    async def start_agent(self, host: str) -> None: ...


class Network(Protocol):
    """Cuts a host off from the others, and heals that."""

    async def cut(self, host: str) -> None: ...

    async def heal(self, host: str) -> None: ...


@attrs.frozen
class CommandNetwork:
    """A :class:`Network` made of two shell commands of the user's, ``{host}`` in each
    replaced by the host's name (quoted): ``cut`` isolates it, ``heal`` undoes that."""

    cut_command: str
    heal_command: str

    async def cut(self, host: str) -> None:
        await _run(self.cut_command, host)

    async def heal(self, host: str) -> None:
        await _run(self.heal_command, host)


async def _run(template: str, host: str) -> None:
    command = template.replace("{host}", shlex.quote(host))
    result = await anyio.run_process(["sh", "-c", command], check=False)
    if result.returncode != 0:
        detail = result.stderr.decode(errors="replace").strip()
        raise KernelError(f"{command!r} exited with {result.returncode}: {detail}")


def _check_hold(instance: object, attribute: object, value: tuple[float, float]) -> None:
    low, high = value
    if not 0 <= low <= high:
        raise ConfigError("hold_s", value, "(low, high) seconds with 0 <= low <= high")


def _hold(rng: random.Random, hold_s: tuple[float, float]) -> float:
    return round(rng.uniform(*hold_s), 3)


async def _replica_host(kernel: ChaosKernel, rng: random.Random) -> tuple[str, list[int], int]:
    """A host holding a live replica (drawn), its live replicas, and the executor."""
    executor, view = await executor_of(kernel)
    hosts = sorted({view.hosts[n] for n in view.alive if n in view.hosts})
    if not hosts:
        raise KernelError(f"kernel {kernel.kernel_id} has no live replica on a known host")
    host = rng.choice(hosts)
    return host, [n for n in view.alive if view.hosts.get(n) == host], executor


@attrs.frozen
class PartitionHost:
    """Cut a host holding a replica off the network for ``hold_s`` seconds (drawn from
    that range), then heal the partition. Long enough, the gateway gives the host up and
    replaces its replicas; the host's stale replicas are stopped once it is back."""

    network: Network | None = None
    hold_s: tuple[float, float] = attrs.field(default=(2.0, 8.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "partition-host"

    @property
    def needs(self) -> frozenset[Capability]:
        return frozenset({"partition"})

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        network = _given(self.network, self, kernel)
        host, nodes, executor = await _replica_host(kernel, rng)
        hold = _hold(rng, self.hold_s)
        await network.cut(host)
        target = f"host {host} ({described(nodes, executor)}) for {hold} s"
        return Strike(target, (), hold, host=host)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        network = _given(self.network, self, kernel)
        assert strike.host is not None
        await network.heal(strike.host)


@attrs.frozen
class KillGateway:
    """``kill -9`` the gateway mid-cell, leave it down ``hold_s`` seconds, then start it
    again from its durable state (a supervisor's restart): every kernel must be taken
    back, with its state. The reply of the cell in flight died with the front."""

    processes: GatewayProcesses | None = None
    hold_s: tuple[float, float] = attrs.field(default=(0.5, 3.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "kill-gateway"

    @property
    def needs(self) -> frozenset[Capability]:
        return frozenset({"gateway-processes"})

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        processes = _given(self.processes, self, kernel)
        hold = _hold(rng, self.hold_s)
        await processes.kill_gateway()
        await anyio.sleep(hold)
        await processes.start_gateway()
        target = f"the gateway, down for {hold} s"
        return Strike(target, (), noticed=True, replies_lost=True)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: started again by the strike, so the cells after it can run."""


@attrs.frozen
class KillAgent:
    """``kill -9`` the agent of a host holding a replica (its replicas run on), leave it
    down ``hold_s`` seconds, then start it again: it takes its replicas back."""

    processes: GatewayProcesses | None = None
    hold_s: tuple[float, float] = attrs.field(default=(0.5, 3.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "kill-agent"

    @property
    def needs(self) -> frozenset[Capability]:
        return frozenset({"gateway-processes"})

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        processes = _given(self.processes, self, kernel)
        host, nodes, executor = await _replica_host(kernel, rng)
        hold = _hold(rng, self.hold_s)
        await processes.kill_agent(host)
        target = f"agent of {host} ({described(nodes, executor)}) for {hold} s"
        return Strike(target, (), hold, host=host)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        assert strike.host is not None
        await _given(self.processes, self, kernel).start_agent(strike.host)


def _given(
    tool: T | None, nemesis: KillGateway | KillAgent | PartitionHost, kernel: ChaosKernel
) -> T:
    if tool is None:
        raise NemesisUnsupportedError(nemesis.name, sorted(nemesis.needs), kernel.where)
    return tool
