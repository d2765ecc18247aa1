"""The ``ExecutorChooser`` interface: which replica runs the next cell, with which GPUs.

The kernel front asks its chooser for each cell's plan; the gateway's GPU-aware
chooser (``nbos.gateway``) and the front's default, the last executor
(``nbos.kernel.front.LastExecutorChooser``), are two; a user's code may pass its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.frozen
class ChoiceRequest:
    """What the front knows when a cell arrives: its index, the last executor, the live replicas.

    ``code`` and ``metadata`` are the ``execute_request``'s (a chooser reads the cell's
    GPU request from them); ``notify(text)`` shows ``text`` (why the cell waits) to the
    client as the cell's wait status, one output that each call replaces
    (:mod:`nbos.kernel.front._status`). ``arrived``: when the request reached the front
    (``time.time()``; ``None``: not known), which the delay's split starts from.
    ``retry_of``: the plan of this cell's previous attempt, whose executor's claim lost
    (nothing ran): the cell goes again under a new index. Its release comes once this
    choice is made, so a chooser may take its GPUs over for the retry rather than let
    another cell have them in between.
    """

    exec_index: int
    last_executor: int | None
    alive: tuple[int, ...]
    code: str = ""
    metadata: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    notify: Callable[[str], Awaitable[None]] | None = attrs.field(default=None, hash=False)
    arrived: float | None = attrs.field(default=None, hash=False)
    retry_of: CellPlan | None = attrs.field(default=None, hash=False)


@attrs.frozen
class CellPlan:
    """Run the cell on ``replica`` with GPUs ``devices`` (host-local indices, pre-committed).

    ``code``, when not ``None``, is forwarded in place of the request's code (a chooser
    that strips a ``%%gpus N`` line, so every replica runs the same code).
    """

    replica: int
    devices: tuple[int, ...] = ()
    code: str | None = None


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
