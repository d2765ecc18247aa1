"""The executor's claims of cells: who runs a cell is whoever's claim committed first.

A replica claims a cell's index in the kernel's log before it runs the cell. Its
``Done`` of a cell claims the next index too (the front keeps sending cells to the
last executor while it lives), so that cell finds its claim committed: an *early*
claim, checked against the log again unless it is fresh, because the front may have
had the index settled as lost since.
"""

from __future__ import annotations

import logging
import time

import attrs

from nbos.core.wire.entries import Claim
from nbos.kernel.protocol import CLAIM_FRESH_S
from nbos.kernel.replica._machine import KernelStateMachine
from nbos.kernel.replica._member_thread import RaftMemberThread

log = logging.getLogger(__name__)


def _clock() -> float:
    # Counts the time a process was frozen and a machine suspended: a thawed or resumed
    # replica finds its early claim stale.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@attrs.frozen
class _EarlyClaim:
    """Our claim of cell ``index``, committed with the previous cell's ``Done`` at ``at``."""

    index: int
    at: float

    def fresh(self) -> bool:
        return _clock() - self.at < CLAIM_FRESH_S


class Claims:
    """The claims of replica ``node`` through its Raft member ``raft``, checked in its
    applied state ``machine``."""

    def __init__(self, node: int, raft: RaftMemberThread, machine: KernelStateMachine) -> None:
        self._node = node
        self._raft = raft
        self._machine = machine
        self._early: _EarlyClaim | None = None

    def claimed_next(self, index: int) -> None:
        """Our ``Done`` of cell ``index - 1`` committed, and with it our claim of ``index``."""
        self._early = _EarlyClaim(index, _clock())

    async def claim(self, index: int) -> int:
        """The replica whose claim of cell ``index`` committed first (maybe ours, made early)."""
        early, self._early = self._early, None
        if early is not None and early.index == index:
            return await self._still_ours(early)
        # A claim committed now is its own barrier: had a Done for the index committed
        # before it, the claim would have lost.
        outcome = await self._raft.propose(Claim(index, self._node))
        return outcome.winner

    async def _still_ours(self, early: _EarlyClaim) -> int:
        """Our early claim, checked against the log as of now: ``-1`` if it was lost.

        Since it committed, the front may have had the index settled as lost (this
        replica was frozen or cut off meanwhile), and a lost cell must never run. Unless
        the claim is fresh (:data:`CLAIM_FRESH_S`), a read barrier makes this replica
        apply what committed until now before it looks.
        """
        if not early.fresh():
            await self._raft.caught_up()
        if self._machine.claim_stands(early.index, self._node):
            return self._node
        log.warning("cell %d was settled without this replica; it does not run", early.index)
        return -1
