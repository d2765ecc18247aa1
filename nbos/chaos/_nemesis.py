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
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import attrs

from nbos.chaos._checks import Violation
from nbos.chaos._target import Capability, ChaosKernel, KernelView
from nbos.core.errors import KernelError

log = logging.getLogger(__name__)

_POLL_S = 0.05


@attrs.frozen
class Strike:
    """A fault in force: a readable ``target``, the replica ``victims``, and how long
    (``lasts_s``, from the strike) the runner keeps it in force before healing.

    ``noticed``: the kernel noticed the fault before the strike returned (a victim
    restarted at once was seen dead first); else the runner watches for that.
    ``host``: the host struck, for a fault of a whole host (its agent, its network).
    ``replies_lost``: the fault ended the process the client talks to (the gateway, and
    the kernel's front in it), so a cell in flight then gets no answer; such a cell is
    held to at most once, as one of no known outcome.
    ``found``: promises the nemesis itself saw broken while striking (a malformed request
    the gateway did not refuse), reported with the fault's other violations;
    ``checked``: the invariants those were checked against (``INVARIANTS`` names).
    ``pids``: processes of this machine the strike stopped or started, for its heal.
    """

    target: str
    victims: tuple[int, ...]
    lasts_s: float = 0.0
    noticed: bool = False
    host: str | None = None
    replies_lost: bool = False
    found: tuple[Violation, ...] = ()
    checked: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()


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

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        """Inject the fault (a workload cell is running); return once it is in force."""
        ...

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """End the fault (thaw, restart ...); the runner then waits for full strength."""
        ...


async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``predicate()`` holds (polled: the front's state has no event to await)."""
    while not await predicate():  # noqa: ASYNC110
        await anyio.sleep(_POLL_S)


async def executor_of(kernel: ChaosKernel) -> tuple[int, KernelView]:
    """The replica running the current cell, else the last executor, else the first alive;
    and the view it was chosen from."""
    view = await kernel.view()
    node = view.running_on if view.running_on is not None else view.last_executor
    if node is None or node not in view.alive:
        if not view.alive:
            raise KernelError(f"kernel {kernel.kernel_id} has no live replica to strike")
        return view.alive[0], view
    return node, view


def followers_of(view: KernelView, executor: int) -> list[int]:
    """The live replicas other than ``executor``, ascending."""
    return [n for n in view.alive if n != executor]


def described(nodes: list[int], executor: int) -> str:
    """``replica 2 (executor)``, ``replicas 1, 3``: a strike's target for the report."""
    names = ", ".join(f"{n} (executor)" if n == executor else str(n) for n in nodes)
    return f"replica{'s' if len(nodes) > 1 else ''} {names}"


async def kill(kernel: ChaosKernel, node: int) -> None:
    """``kill -9`` replica ``node`` and wait for its end; the cluster notices on its own."""
    await kernel.signal_replica(node, signal.SIGKILL)
    await kernel.wait_replica(node)


async def restart_in_place(kernel: ChaosKernel, node: int) -> None:
    """Start killed replica ``node`` again on its host, from its durable Raft log.

    A cluster that cannot (not durable), or that is replacing it already, is left to
    heal by itself: the runner waits for the kernel to be back to full strength.
    """
    try:
        await kernel.restart_replica(node)
    except KernelError as exc:
        log.info("chaos: replica %d not restarted (%s); the cluster must replace it", node, exc)
