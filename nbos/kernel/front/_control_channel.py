"""The front's control channel: interrupts go to the cell in progress, wherever it is,
``shutdown_request`` to every replica, anything else to one live replica.

An interrupt belongs to the cell in progress from the moment the front takes the
cell: one that comes while the cell waits for its executor ends the wait; one that
comes before the cell is sent follows it (:mod:`._shell`); one for a cell on its way
names it, so that the replica keeps it until the cell comes (shell and control are
not ordered).
"""

from __future__ import annotations

import logging

import anyio
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream

from nbos.core.errors import NbosError
from nbos.kernel import protocol
from nbos.kernel.front import _wire
from nbos.kernel.front._cells import Cells
from nbos.kernel.front._clients import ClientChannels, Incoming
from nbos.kernel.front._liveness import Liveness
from nbos.kernel.front._relay import IDLE_GRACE_S, Relay
from nbos.kernel.front._shell import ShellWorker

log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0


class ControlWorker:
    """Serves kernel ``kernel_id``'s control requests, relayed through ``relay``;
    ``shutdown_requested`` is set once a client asked the kernel to shut down."""

    def __init__(
        self,
        kernel_id: str,
        *,
        clients: ClientChannels,
        relay: Relay,
        cells: Cells,
        liveness: Liveness,
        shell: ShellWorker,
        shutdown_requested: anyio.Event,
    ) -> None:
        self._kernel_id = kernel_id
        self._clients = clients
        self._relay = relay
        self._cells = cells
        self._liveness = liveness
        self._shell = shell
        self._shutdown_requested = shutdown_requested

    async def serve(self, rx: MemoryObjectReceiveStream[Incoming]) -> None:
        async for idents, msg in rx:
            msg_type = msg["header"]["msg_type"]
            await self._clients.publish_status("busy", msg)
            try:
                if await self._clients.screen(idents, msg, "control"):
                    await self._serve(idents, msg)
            except (NbosError, zmq.ZMQError, KeyError, TypeError, ValueError):
                log.exception("kernel %s: %s failed", self._kernel_id, msg_type)
            finally:
                await self._clients.publish_status("idle", msg)

    async def _serve(self, idents: list[bytes], msg: _wire.Msg) -> None:
        msg_type = msg["header"]["msg_type"]
        if msg_type == "shutdown_request":
            await self._shutdown(idents, msg)
        elif msg_type == "interrupt_request":
            await self._interrupt(idents, msg)
        else:
            await self._relay.relay(
                idents, msg, "control", self._clients.control, self._cells.last_executor
            )

    async def _interrupt(self, idents: list[bytes], msg: _wire.Msg) -> None:
        """Interrupt the cell in progress where it is: its wait to run, its replica."""
        cell, active = self._shell.cell, self._relay.active
        if cell is None:
            target = active.target if active is not None else self._cells.last_executor
            await self._forward_interrupt(idents, msg, target)
            return
        cell.interrupted = True
        if active is not None and active.sent:
            # The replica may get it before the cell itself (shell and control are not
            # ordered): naming the cell lets it keep the interrupt until the cell comes.
            metadata = protocol.interrupt_metadata(msg["metadata"], cell.msg_id)
            await self._forward_interrupt(idents, {**msg, "metadata": metadata}, active.target)
            return
        if cell.choosing is not None:
            # The cell waits for its executor (GPUs): it has not started anywhere yet.
            cell.choosing.cancel()
        # Otherwise the cell is not on its way to a replica yet: the interrupt follows it
        # when it is sent (``ShellWorker._cell_sent``).
        reply = self._clients.new_message("interrupt_reply", {"status": "ok"}, msg)
        await self._clients.send(self._clients.control, reply, idents)

    async def _forward_interrupt(
        self, idents: list[bytes], msg: _wire.Msg, target: int | None
    ) -> None:
        alive = self._liveness.alive
        if target is None or target not in alive:
            target = alive[0] if alive else None
        if target is None:
            await self._clients.reply_error(idents, msg, "control", self._cells.refusal())
            return
        pending = await self._relay.roundtrip(target, "control", msg, idents, grace=IDLE_GRACE_S)
        content = {"status": "ok"} if pending.reply is None else pending.reply["content"]
        reply = self._clients.new_message("interrupt_reply", content, msg)
        await self._clients.send(self._clients.control, reply, idents)

    async def _shutdown(self, idents: list[bytes], msg: _wire.Msg) -> None:
        # Replicas that end from now on are expected to.
        self._liveness.closing = True
        restart = bool(msg["content"].get("restart", False))
        with anyio.move_on_after(_SHUTDOWN_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for replica in self._liveness.alive:
                    tg.start_soon(self._shutdown_one, replica)
        content = {"status": "ok", "restart": restart}
        reply = self._clients.new_message("shutdown_reply", content, msg)
        await self._clients.send(self._clients.control, reply, idents)
        await self._clients.publish(self._clients.new_message("shutdown_reply", content, msg))
        self._shutdown_requested.set()

    async def _shutdown_one(self, replica: int) -> None:
        await self._relay.control_request(
            replica, "shutdown_request", {"restart": False}, timeout=_SHUTDOWN_TIMEOUT_S
        )
