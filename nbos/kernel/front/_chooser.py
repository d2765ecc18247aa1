"""Which replica runs the next cell: the hook where GPU-aware scheduling plugs in."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from nbos.core.errors import QuorumLostError


@attrs.frozen
class ChoiceRequest:
    """What the front knows when a cell arrives: its index, the last executor, the live replicas."""

    exec_index: int
    last_executor: int | None
    alive: tuple[int, ...]


@attrs.frozen
class CellPlan:
    """Run the cell on ``replica`` with GPUs ``devices`` (host-local indices, pre-committed)."""

    replica: int
    devices: tuple[int, ...] = ()


@runtime_checkable
class ExecutorChooser(Protocol):
    """Picks the executor of each cell and releases what it committed for it.

    ``choose`` may wait (for GPUs to free up) and must return a replica in
    ``request.alive``; ``release`` is called exactly once per returned plan, on
    every path (reply, error, executor lost).
    """

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        """The plan for cell ``request.exec_index``."""
        ...

    async def release(self, plan: CellPlan) -> None:
        """The cell of ``plan`` finished (in whatever way)."""
        ...


class LastExecutorChooser:
    """No GPUs: the last executor while it lives, else the lowest-numbered live replica."""

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        if not request.alive:
            raise QuorumLostError("no replica of the kernel is alive")
        if request.last_executor in request.alive:
            return CellPlan(request.last_executor)
        return CellPlan(min(request.alive))

    async def release(self, plan: CellPlan) -> None:
        return None
