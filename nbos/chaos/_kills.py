"""Nemeses that ``kill -9`` replicas: the executor, a follower, or two at once."""

from __future__ import annotations

import random
import signal

import attrs

from nbos.chaos._nemesis import (
    EMBEDDED,
    Capability,
    Strike,
    described,
    executor_of,
    followers_of,
    kill,
    restart_in_place,
)
from nbos.cluster import Kernel
from nbos.core.errors import KernelError


@attrs.frozen
class KillExecutor:
    """``kill -9`` the replica running the cell: the client must get the cell's result
    (if its ``Done`` committed) or ``CellLostError``, and the next cell runs elsewhere.

    ``restart``: start the victim again in place from its durable Raft log, rather
    than leave it to the cluster's replacement policy.
    """

    restart: bool = False
    name: str = "kill-executor"
    needs: frozenset[Capability] = EMBEDDED

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        node = executor_of(kernel)
        await kill(kernel, node)
        return Strike(described([node], node), (node,))

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        if self.restart:
            await restart_in_place(kernel, strike.victims[0])


@attrs.frozen
class KillFollower:
    """``kill -9`` a replica that is not running the cell: the cell and the kernel go on.

    ``restart`` as for :class:`KillExecutor`.
    """

    restart: bool = False
    name: str = "kill-follower"
    needs: frozenset[Capability] = EMBEDDED

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        executor = executor_of(kernel)
        followers = followers_of(kernel, executor)
        if not followers:
            raise KernelError(f"kernel {kernel.kernel_id} has no live follower to kill")
        node = rng.choice(followers)
        await kill(kernel, node)
        return Strike(described([node], executor), (node,))

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        if self.restart:
            await restart_in_place(kernel, strike.victims[0])


@attrs.frozen
class KillTwo:
    """``kill -9`` two of the three replicas at once (the executor among them or not).

    Without a majority the client must get ``QuorumLostError`` at once; both are then
    restarted from their durable logs (no replacement can join without a majority),
    and the kernel must serve again with every acknowledged cell and no lost one.
    """

    name: str = "kill-two"
    needs: frozenset[Capability] = EMBEDDED

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        executor = executor_of(kernel)
        victims = sorted(rng.sample(list(kernel.front.alive), 2))
        for node in victims:
            await kernel.signal_replica(node, signal.SIGKILL)
        for node in victims:
            await kernel.wait_replica(node)
        return Strike(described(victims, executor), tuple(victims))

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        for node in strike.victims:
            await restart_in_place(kernel, node)
