"""What a nemesis is: something that breaks a running kernel, then lets it heal.

The runner drives each fault the same way: it starts a slow workload cell, calls
:meth:`Nemesis.strike` while that cell runs, sends one more cell while the fault is
in force, waits :attr:`Strike.lasts_s` from the strike, calls :meth:`Nemesis.heal`,
then waits for the kernel to serve cells on all its replicas again.
"""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Callable
from typing import Literal, Protocol

import anyio
import attrs

from nbos.cluster import Kernel
from nbos.core.errors import KernelError

log = logging.getLogger(__name__)

_POLL_S = 0.05

#: What a nemesis may need of the cluster under test.
#: ``replica-processes``: signals to a kernel's replica processes (the embedded cluster);
#: ``gateway``: a gateway process, its host agents and hosts on a network it can cut.
Capability = Literal["replica-processes", "gateway"]

#: What the embedded :class:`~nbos.cluster.LocalCluster` offers.
EMBEDDED: frozenset[Capability] = frozenset({"replica-processes"})


@attrs.frozen
class Strike:
    """A fault in force: a readable ``target``, the replica ``victims``, and how long
    (``lasts_s``, from the strike) the runner keeps it in force before healing.

    ``noticed``: the kernel noticed the fault before the strike returned (a victim
    restarted at once was seen dead first); else the runner watches for that.
    """

    target: str
    victims: tuple[int, ...]
    lasts_s: float = 0.0
    noticed: bool = False


class Nemesis(Protocol):
    """A kind of fault. ``rng`` is the fault's own seeded generator: make every random
    choice (victim, duration) from it, so a seed replays the same faults."""

    @property
    def name(self) -> str:
        """Short, unique, for schedules and reports (``kill-executor``)."""
        ...

    @property
    def needs(self) -> frozenset[Capability]:
        """What the cluster must offer; the runner refuses a nemesis it cannot run."""
        ...

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        """Inject the fault (a workload cell is running); return once it is in force."""
        ...

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        """End the fault (thaw, restart ...); the runner then waits for full strength."""
        ...


async def until(predicate: Callable[[], bool]) -> None:
    """Return once ``predicate()`` holds (polled: the front's state has no event to await)."""
    while not predicate():  # noqa: ASYNC110
        await anyio.sleep(_POLL_S)


def executor_of(kernel: Kernel) -> int:
    """The replica running the current cell, else the last executor, else the first alive."""
    front = kernel.front
    node = front.running_on if front.running_on is not None else front.last_executor
    if node is None or node not in front.alive:
        if not front.alive:
            raise KernelError(f"kernel {kernel.kernel_id} has no live replica to strike")
        return front.alive[0]
    return node


def followers_of(kernel: Kernel, executor: int) -> list[int]:
    """The live replicas other than ``executor``, ascending."""
    return [n for n in kernel.front.alive if n != executor]


def described(nodes: list[int], executor: int) -> str:
    """``replica 2 (executor)``, ``replicas 1, 3``: a strike's target for the report."""
    names = ", ".join(f"{n} (executor)" if n == executor else str(n) for n in nodes)
    return f"replica{'s' if len(nodes) > 1 else ''} {names}"


async def kill(kernel: Kernel, node: int) -> None:
    """``kill -9`` replica ``node`` and reap it; the cluster notices the exit on its own."""
    await kernel.signal_replica(node, signal.SIGKILL)
    await kernel.wait_replica(node)


async def restart_in_place(kernel: Kernel, node: int) -> None:
    """Start killed replica ``node`` again on its host, from its durable Raft log.

    A cluster that cannot (not durable), or that is replacing it already, is left to
    heal by itself: the runner waits for the kernel to be back to full strength.
    """
    try:
        await kernel.restart_replica(node)
    except KernelError as exc:
        log.info("chaos: replica %d not restarted (%s); the cluster must replace it", node, exc)
