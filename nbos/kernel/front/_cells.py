"""The front's side of the cell protocol: exec indices, executor claims, settling.

Each cell gets the next ``exec_index``; the replica it goes to claims that index in
the kernel's log, and only the first committed claim runs. A cell whose replica lost
the claim (another replica claimed the index early) is sent again under a new index,
and the retired index is *settled*: a live replica commits ``Done(index, lost)`` so
that the cells after it can run. So is the index of a cell whose executor died. A
settle that finds no majority keeps its index; it is settled again, in order, before
the next cell, which could not run before it anyway.

No sockets here: requests to replicas go through ``ask`` (the front's
``control_request``) and :class:`ReplicaView` says which replicas count, so the
protocol is driven directly in tests.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import anyio

from nbos.core.errors import CellLostError, KernelError, NbosError, QuorumLostError
from nbos.kernel import protocol

log = logging.getLogger(__name__)

#: How many indices one cell may go through before the client gets an error.
CLAIM_ATTEMPTS = 3
#: How long a replica may take to commit a settle, or to say where the cells stand.
LOG_TIMEOUT_S = 30.0

_Plan = TypeVar("_Plan")


class ReplicaView(Protocol):
    """Which of the kernel's replicas count (the front's liveness)."""

    @property
    def alive(self) -> tuple[int, ...]: ...

    @property
    def members(self) -> tuple[int, ...]: ...

    @property
    def has_quorum(self) -> bool: ...


class Ask(Protocol):
    """A control request to one replica; its reply, ``None`` if there was none in time."""

    async def __call__(
        self,
        replica: int,
        msg_type: str,
        content: Mapping[str, Any],
        *,
        timeout: float,
        needs_quorum: bool = False,
    ) -> dict[str, Any] | None: ...


class CellRefused(Exception):
    """The cell cannot run (anywhere, now); ``error`` is what its error reply says."""

    def __init__(self, error: NbosError) -> None:
        super().__init__(str(error))
        self.error = error


class Cells:
    """Exec indices, claims and settles of one kernel's cells, as its front sees them."""

    def __init__(
        self,
        kernel_id: str,
        replicas: ReplicaView,
        ask: Ask,
        unavailable: Callable[[str], QuorumLostError] = QuorumLostError,
    ) -> None:
        # ``unavailable(account)``: the error of a cell refused for want of a majority,
        # given the account of the replicas (``only replicas [2] of [1, 2, 3] are alive``).
        self._kernel_id = kernel_id
        self._replicas = replicas
        self._ask = ask
        self._unavailable = unavailable
        self._next_index = 1
        self._settled_index = 0
        #: Indices whose settle found no majority.
        self._unsettled: set[int] = set()
        self._settling = anyio.Lock()
        self._last_executor: int | None = None

    @property
    def last_exec_index(self) -> int:
        """The ``exec_index`` given to the latest cell (0 before the first)."""
        return self._next_index - 1

    @property
    def settled_exec_index(self) -> int:
        """The ``exec_index`` of the latest cell whose reply went to the client (0 before)."""
        return self._settled_index

    @property
    def last_executor(self) -> int | None:
        """The replica that ran the last cell (``None`` before the first, or once it died)."""
        return self._last_executor

    @property
    def has_unsettled(self) -> bool:
        """Whether some index waits for a majority to be settled."""
        return bool(self._unsettled)

    def ran_on(self, replica: int) -> None:
        """``replica`` won its claim and replied: the next cell goes there if it can."""
        self._last_executor = replica

    def forget(self, replica: int) -> None:
        """``replica`` is gone for good: it is nobody's last executor."""
        if self._last_executor == replica:
            self._last_executor = None

    async def run(
        self,
        choose: Callable[[int], Awaitable[_Plan]],
        execute: Callable[[int, _Plan], Awaitable[str | None]],
    ) -> str:
        """Run one cell: ``choose(index)`` its plan, then ``execute(index, plan)``, which
        returns the status of the reply the client got, or ``None`` if the replica's claim
        lost (nothing ran; the cell goes again under a new index).

        Raises :class:`CellRefused` if it cannot run: no majority, an earlier index still
        unsettled, ``choose`` failed (with its :class:`NbosError`), no claim won.
        """
        if not self._replicas.has_quorum or not await self.settle_unsettled():
            # Without a majority nothing can commit: say so now rather than time out.
            raise self._quorum_lost()
        for _ in range(CLAIM_ATTEMPTS):
            index = self._next_index
            self._next_index += 1
            try:
                plan = await choose(index)
            except NbosError as exc:
                log.warning("kernel %s: no executor for cell %d: %s", self._kernel_id, index, exc)
                self._next_index = index  # nothing was sent under it: the next cell takes it
                raise CellRefused(exc) from exc
            status = await execute(index, plan)
            if status is not None:
                self._settled_index = index
                return status
            # Another replica holds the index's claim (its Done of the cell before claimed
            # it, and it was not chosen after all, or died): retire the index and send the
            # cell again under a new one.
            if await self.settle(index) is None:
                raise self._quorum_lost()
        failure = KernelError(f"no replica could claim the cell in {CLAIM_ATTEMPTS} attempts")
        raise CellRefused(failure)

    def refusal(self) -> QuorumLostError:
        """What a request is told that the kernel cannot serve: no majority is alive."""
        replicas = self._replicas
        return self._unavailable(
            f"only replicas {list(replicas.alive)} of {list(replicas.members)} are alive"
        )

    def _quorum_lost(self) -> CellRefused:
        lost = (
            self.refusal()
            if not self._replicas.has_quorum
            else QuorumLostError(
                f"cells {sorted(self._unsettled)} could not be settled: no majority answered"
            )
        )
        log.warning("kernel %s: %s", self._kernel_id, lost)
        return CellRefused(lost)

    async def lost(self, index: int, executor: int) -> dict[str, Any]:
        """Cell ``index``'s ``executor`` died before its reply: settle the cell; the
        content of the client's ``execute_reply``."""
        self._last_executor = None
        content = lost_cell_reply(index, executor, await self.settle(index))
        log.warning("kernel %s: cell %d settled as %s", self._kernel_id, index, content["status"])
        return content

    async def settle(self, index: int) -> dict[str, Any] | None:
        """Have a live replica commit ``Done(index, lost)``; what it says counts for the cell.

        ``None`` (at once when no majority is alive) if none could: the index is then
        kept and settled again once a majority is back (:meth:`settle_unsettled`).
        """
        for survivor in self._replicas.alive:
            if not self._replicas.has_quorum:
                break
            reply = await self._ask(
                survivor,
                protocol.LOST_REQUEST,
                {protocol.LOST_INDEX: index},
                timeout=LOG_TIMEOUT_S,
                needs_quorum=True,
            )
            if reply is not None and reply["content"].get("status") == "ok":
                self._unsettled.discard(index)
                settled: dict[str, Any] = reply["content"]
                return settled
        self._unsettled.add(index)
        log.warning("kernel %s: cell %d is not settled yet", self._kernel_id, index)
        return None

    async def settle_unsettled(self) -> bool:
        """Settle the indices whose settle found no majority, in order; whether all are."""
        if not self._unsettled:
            # Every cell asks: not even a turn of the loop for the lock, then.
            return True
        async with self._settling:
            for index in sorted(self._unsettled):
                settled = await self.settle(index)
                if settled is None:
                    return False
                log.info(
                    "kernel %s: cell %d settled as %s",
                    self._kernel_id,
                    index,
                    settled.get(protocol.CELL_STATUS),
                )
            return True

    async def resume(self) -> None:
        """Go on after the cells that ran under an earlier front: from the last ``Done`` the
        replicas' log committed, with the replica that claimed the next cell (a cell still
        running there, or its early claim) as the last executor, so the next cell goes
        there if it can. An index it gets wrong costs a lost claim and a retry, no more.
        """
        last_done, claimant = 0, -1
        for replica in self._replicas.alive:
            reply = await self._ask(replica, protocol.PROGRESS_REQUEST, {}, timeout=LOG_TIMEOUT_S)
            if reply is None or reply["content"].get("status") != "ok":
                continue
            content = reply["content"]
            if int(content.get(protocol.LAST_DONE, 0)) >= last_done:
                last_done = int(content.get(protocol.LAST_DONE, 0))
                claimant = int(content.get(protocol.NEXT_CLAIMED_BY, -1))
        self._next_index = last_done + 1
        self._settled_index = last_done
        if claimant in self._replicas.alive:
            self._last_executor = claimant
        log.info(
            "kernel %s taken over after cell %d (next claimed by %s)",
            self._kernel_id,
            last_done,
            claimant if claimant >= 0 else "none",
        )


def lost_cell_reply(index: int, executor: int, settled: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``execute_reply`` content of cell ``index``, whose ``executor`` died before its
    reply, from the reply to its settle (``None``: no majority could settle it)."""
    if settled is None:
        exc: NbosError = QuorumLostError(
            f"cell {index} stopped with its kernel's majority of replicas: it is settled "
            "(committed or lost) once a majority is back"
        )
        return protocol.error_content(exc, 0)
    if settled.get(protocol.CELL_STATUS) == "lost":
        count = int(settled.get(protocol.EXECUTION_COUNT, 0))
        return protocol.error_content(CellLostError(index, executor), count)
    # The executor committed the cell and died before its reply reached us.
    content: dict[str, Any] = {
        "status": settled.get(protocol.CELL_STATUS, "ok"),
        "execution_count": int(settled.get(protocol.EXECUTION_COUNT, 1)) - 1,
        "user_expressions": {},
        "payload": [],
    }
    if content["status"] == "error":
        content.update(protocol.error_content(KernelError(f"cell {index} failed"), 0))
    return content
