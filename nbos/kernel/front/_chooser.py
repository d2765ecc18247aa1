"""The front's default :class:`~nbos.core.executor_chooser.ExecutorChooser`: the last executor."""

from __future__ import annotations

from nbos.core.errors import QuorumLostError
from nbos.core.executor_chooser import CellPlan, ChoiceRequest


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
