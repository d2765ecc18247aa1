"""Nemeses that ``kill -9`` replicas: the executor, a follower, or two at once."""

from __future__ import annotations

import random
import signal

import attrs

from nbos.chaos._nemesis import (
    Strike,
    described,
    executor_of,
    followers_of,
    kill,
    restart_in_place,
    until,
)
from nbos.chaos._target import EMBEDDED, Capability, ChaosKernel
from nbos.core.errors import KernelError


@attrs.frozen
class KillExecutor:
    """``kill -9`` the replica running the cell: the client must get the cell's result
    (if its ``Done`` committed) or ``CellLostError``, and the next cell runs elsewhere.

    ``mid_cell=False`` waits for the cell to end and kills the replica that ran it
    (``kill-last-executor``). ``restart``: as soon as the cluster noticed the death,
    start the victim again in place from its durable Raft log (a crash that a
    supervisor restarts; ``...+restart``), rather than leave it to the cluster's
    replacement policy.
    """

    mid_cell: bool = True
    restart: bool = False

    @property
    def needs(self) -> frozenset[Capability]:
        return EMBEDDED

    @property
    def name(self) -> str:
        base = "kill-executor" if self.mid_cell else "kill-last-executor"
        return f"{base}+restart" if self.restart else base

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        if not self.mid_cell:
            await until(lambda: _idle(kernel))
        node, _ = await executor_of(kernel)
        return await _kill(kernel, node, node, restart=self.restart)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: restarted at once, or left to the cluster."""


@attrs.frozen
class KillFollower:
    """``kill -9`` a replica that is not running the cell: the cell and the kernel go on.

    ``restart`` as for :class:`KillExecutor`.
    """

    restart: bool = False

    @property
    def name(self) -> str:
        return "kill-follower+restart" if self.restart else "kill-follower"

    @property
    def needs(self) -> frozenset[Capability]:
        return EMBEDDED

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        executor, view = await executor_of(kernel)
        followers = followers_of(view, executor)
        if not followers:
            raise KernelError(f"kernel {kernel.kernel_id} has no live follower to kill")
        return await _kill(kernel, rng.choice(followers), executor, restart=self.restart)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: restarted at once, or left to the cluster."""


@attrs.frozen
class KillTwo:
    """``kill -9`` two of the three replicas at once (the executor among them or not).

    Without a majority the client must get ``QuorumLostError`` (or, from the kernel dead
    until they are restarted, ``KernelDeadError``) at once; both are then
    restarted from their durable logs (no replacement can join without a majority),
    and the kernel must serve again with every acknowledged cell and no lost one.
    """

    @property
    def name(self) -> str:
        return "kill-two"

    @property
    def needs(self) -> frozenset[Capability]:
        return EMBEDDED

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        executor, view = await executor_of(kernel)
        victims = sorted(rng.sample(list(view.alive), 2))
        for node in victims:
            await kernel.signal_replica(node, signal.SIGKILL)
        for node in victims:
            await kernel.wait_replica(node)
        return Strike(described(victims, executor), tuple(victims))

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        for node in strike.victims:
            await restart_in_place(kernel, node)


async def _kill(kernel: ChaosKernel, node: int, executor: int, *, restart: bool) -> Strike:
    await kill(kernel, node)
    if not restart:
        return Strike(described([node], executor), (node,))
    await restart_in_place(kernel, node)
    return Strike(f"{described([node], executor)}, restarted", (node,), noticed=True)


async def _idle(kernel: ChaosKernel) -> bool:
    return (await kernel.view()).running_on is None
