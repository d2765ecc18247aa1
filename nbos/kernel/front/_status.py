"""A cell's wait status, shown to clients as one output updated in place.

A cell may wait before it runs anywhere (for GPUs, for a replica to migrate). The
first reason is published as a ``display_data`` with a transient ``display_id``;
every later reason, and the end of the wait, as an ``update_display_data`` of
that id, which Jupyter front ends (JupyterLab, Notebook, VS Code, nbclient) render
by replacing the output in place. So a notebook shows one line: why the cell
waits while it does, and how long it waited once it started. A cell that never
waited shows nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

#: ``publish(msg_type, content)``: an IOPub message to clients, as the cell's output.
Publish = Callable[[str, dict[str, Any]], Awaitable[None]]


class WaitStatus:
    """The wait status of one cell; ``display_id`` must be unique to the cell."""

    def __init__(
        self, publish: Publish, display_id: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._publish = publish
        self._display_id = display_id
        self._clock = clock
        self._shown = False
        #: When the current wait began; ``None`` while the cell does not wait.
        self._since: float | None = None

    @property
    def waiting(self) -> bool:
        """Whether the cell waits now (a reason was shown, and the wait has not ended)."""
        return self._since is not None

    async def waits(self, text: str) -> None:
        """Show ``text`` (why the cell waits) in place of the previous status."""
        now = self._clock()
        if self._since is None:
            self._since = now
        msg_type = "update_display_data" if self._shown else "display_data"
        self._shown = True
        await self._show(msg_type, text, "waiting", now - self._since)

    async def ended(self, *, started: bool) -> None:
        """The wait is over: the cell ``started``, or it never will (an error, an interrupt)."""
        if self._since is None:
            return
        waited = self._clock() - self._since
        self._since = None
        text = (
            f"nbos: the cell started after waiting {waited:.1f} s"
            if started
            else f"nbos: the cell did not start (it waited {waited:.1f} s)"
        )
        status = "started" if started else "not started"
        await self._show("update_display_data", text, status, waited)

    async def _show(self, msg_type: str, text: str, status: str, waited: float) -> None:
        content = {
            "data": {"text/plain": text},
            "metadata": {"nbos": {"status": status, "waited_s": round(waited, 3)}},
            "transient": {"display_id": self._display_id},
        }
        await self._publish(msg_type, content)
