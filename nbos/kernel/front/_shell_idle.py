"""The ``idle`` of the shell request in flight: one per request, once everything of it is out.

It goes out as soon as the request's reply was relayed and so was the output the reply
counts, or the replica's own idle came (:mod:`._relay` tells), or else when the
request is done with. Which requests a failed cell aborts depends on when it went
out: those the shell queue held then (the client sent the others after it saw it).
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream

from nbos.kernel.front import _wire
from nbos.kernel.front._clients import ClientChannels, Incoming


class ShellIdle:
    """The shell request whose ``idle`` is still due, published on ``clients``' IOPub."""

    def __init__(self, clients: ClientChannels) -> None:
        self._clients = clients
        self._due_for: _wire.Msg | None = None
        self._queue: MemoryObjectReceiveStream[Incoming] | None = None
        #: How many requests the shell queue held when the last idle went out: those
        #: are the ones queued behind that request.
        self.queued_at_idle = 0

    def watch(self, queue: MemoryObjectReceiveStream[Incoming]) -> None:
        """Count what ``queue`` (the shell's) holds as each idle goes out."""
        self._queue = queue

    def due(self, parent: _wire.Msg) -> None:
        """Shell request ``parent`` began: its ``idle`` goes out at :meth:`flush`."""
        self._due_for = parent

    async def flush(self) -> None:
        """Publish the shell request's ``idle`` if it is still due."""
        parent, self._due_for = self._due_for, None
        if parent is not None:
            queue = self._queue
            self.queued_at_idle = 0 if queue is None else queue.statistics().current_buffer_used
            await self._clients.publish_status("idle", parent)
