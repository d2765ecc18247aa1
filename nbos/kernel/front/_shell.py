"""The front's shell channel: client requests one at a time, as ipykernel handles them.

An ``execute_request`` gets the next ``exec_index`` (:mod:`._cells`) and goes to the
executor the :class:`ExecutorChooser` picks; everything else goes to one live replica
(comm messages too: the replica puts them through the log to all replicas). A cell
that waits before it runs (for GPUs, for a migration) shows why as one output updated
in place (:mod:`._status`). If the executor dies mid-cell, a survivor commits
``Done(index, lost)`` and the client gets a ``CellLostError`` reply; nothing is re-run.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import anyio
import anyio.abc
import attrs
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream

from nbos.core.errors import KernelError, NbosError
from nbos.core.executor_chooser import CellPlan, ChoiceRequest, ExecutorChooser
from nbos.kernel import protocol
from nbos.kernel.front import _wire
from nbos.kernel.front._cells import CellRefused, Cells
from nbos.kernel.front._clients import ClientChannels, Incoming
from nbos.kernel.front._liveness import Liveness
from nbos.kernel.front._relay import IDLE_GRACE_S, Pending, Relay
from nbos.kernel.front._shell_idle import ShellIdle
from nbos.kernel.front._status import WaitStatus

log = logging.getLogger(__name__)

#: How long an interrupt that follows its cell waits for the replica's reply.
_INTERRUPT_TIMEOUT_S = 10.0


@attrs.define
class RunningCell:
    """A client's ``execute_request`` being run, and whether the client interrupted it."""

    msg_id: str
    interrupted: bool = False
    #: Set while the chooser picks the cell's executor (it may wait for GPUs).
    choosing: anyio.CancelScope | None = None
    #: Why the cell waits to start, shown to clients; ``None`` until it is taken.
    wait: WaitStatus | None = None

    @property
    def waiting(self) -> bool:
        """Whether the cell waits to start (for GPUs, a migration), not yet running."""
        return self.wait is not None and self.wait.waiting


class ShellWorker:
    """Serves kernel ``kernel_id``'s shell requests, relayed through ``relay``; tasks of
    its own (an interrupt following its cell) run in ``tg``."""

    def __init__(
        self,
        kernel_id: str,
        *,
        clients: ClientChannels,
        relay: Relay,
        idle: ShellIdle,
        cells: Cells,
        liveness: Liveness,
        chooser: ExecutorChooser,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        self._kernel_id = kernel_id
        self._clients = clients
        self._relay = relay
        self._idle = idle
        self._cells = cells
        self._liveness = liveness
        self._chooser = chooser
        self._tg = tg
        #: The cell being run, from its turn on the shell to its reply.
        self.cell: RunningCell | None = None

    async def serve(self, rx: MemoryObjectReceiveStream[Incoming]) -> None:
        self._idle.watch(rx)
        async for idents, msg in rx:
            stop = await self._handle(idents, msg, abort=False)
            # As ipykernel does: a cell that fails with stop_on_error aborts the requests
            # queued behind it, not one that the client sent once it saw the cell's idle.
            for _ in range(self._idle.queued_at_idle if stop else 0):
                await self._handle(*rx.receive_nowait(), abort=True)

    async def _handle(self, idents: list[bytes], msg: _wire.Msg, *, abort: bool) -> bool:
        """Handle one shell request; ``True`` if it was a cell whose failure stops the queue."""
        msg_type = msg["header"]["msg_type"]
        self._clients.busy_due(msg)
        self._idle.due(msg)
        try:
            if not await self._clients.screen(idents, msg, "shell"):
                return False
            if msg_type != "execute_request":
                await self._relay.relay(
                    idents, msg, "shell", self._clients.shell, self._cells.last_executor
                )
                return False
            if abort:
                await self._clients.reply(idents, msg, "execute_reply", {"status": "aborted"})
                return False
            status = await self._execute(idents, msg)
            content = msg["content"]
            silent = bool(content.get("silent", False))
            return status == "error" and not silent and content.get("stop_on_error", True)
        except (NbosError, zmq.ZMQError, KeyError, TypeError, ValueError):
            # One request gone wrong must not take the kernel's front down with it.
            log.exception("kernel %s: %s failed", self._kernel_id, msg_type)
            return False
        finally:
            self._clients.arrived.pop(str(msg["header"].get("msg_id", "")), None)
            await self._idle.flush()

    async def _execute(self, idents: list[bytes], msg: _wire.Msg) -> str:
        """Run one cell; returns the status of the reply the client got."""
        self.cell = RunningCell(msg["header"]["msg_id"])
        try:
            return await self._execute_cell(idents, msg, self.cell)
        finally:
            self.cell = None

    async def _execute_cell(self, idents: list[bytes], msg: _wire.Msg, cell: RunningCell) -> str:
        wait = cell.wait = self._wait_status(msg)
        # The plan of an attempt whose claim lost, released once the retry has chosen (the
        # chooser may take its GPUs over: released first, another cell could take them).
        lost: list[CellPlan] = []

        async def choose(index: int) -> CellPlan:
            retry_of = lost.pop() if lost else None
            try:
                plan = await self._choose(msg, index, wait, cell, retry_of)
            except NbosError:
                await wait.ended(started=False)
                raise
            finally:
                if retry_of is not None:
                    await self._chooser.release(retry_of)
            await wait.ended(started=True)
            return plan

        async def execute(index: int, plan: CellPlan) -> str | None:
            claimed = True
            try:
                status = await self._execute_on(idents, msg, index, plan)
                claimed = status is not None
                return status
            finally:
                if claimed:
                    await self._chooser.release(plan)
                else:
                    lost.append(plan)

        try:
            return await self._cells.run(choose, execute)
        except CellRefused as refused:
            return await self._fail_cell(idents, msg, protocol.error_content(refused.error, 0))
        finally:
            for plan in lost:  # no retry came (the lost index could not be settled)
                await self._chooser.release(plan)

    async def _fail_cell(self, idents: list[bytes], msg: _wire.Msg, content: dict[str, Any]) -> str:
        """Answer a cell with the error reply ``content``; returns its status, ``"error"``.

        The error goes out as the cell's ``error`` output too, as a replica's would: a
        notebook shows a cell's outputs, not its reply.
        """
        error = {k: content[k] for k in ("ename", "evalue", "traceback")}
        await self._clients.publish(self._clients.new_message("error", error, msg))
        await self._clients.reply(idents, msg, "execute_reply", content)
        return "error"

    async def _choose(
        self,
        msg: _wire.Msg,
        index: int,
        wait: WaitStatus,
        cell: RunningCell,
        retry_of: CellPlan | None,
    ) -> CellPlan:
        """The chooser's plan for cell ``index``; an interrupt ends a wait (for GPUs)."""
        with anyio.CancelScope() as scope:
            cell.choosing = scope
            if cell.interrupted:
                scope.cancel()
            try:
                return await self._chooser.choose(self._choice_request(msg, index, wait, retry_of))
            finally:
                cell.choosing = None
        raise KernelError(f"cell {index} was interrupted while it waited to run")

    def _wait_status(self, msg: _wire.Msg) -> WaitStatus:
        """The status output of cell ``msg`` while it waits to run, updated in place."""

        async def publish(msg_type: str, content: dict[str, Any]) -> None:
            await self._clients.publish(self._clients.new_message(msg_type, content, msg))

        return WaitStatus(publish, f"nbos-wait-{msg['header']['msg_id']}")

    def _choice_request(
        self, msg: _wire.Msg, index: int, wait: WaitStatus, retry_of: CellPlan | None
    ) -> ChoiceRequest:
        code = msg["content"].get("code", "")
        return ChoiceRequest(
            index,
            self._cells.last_executor,
            self._liveness.alive,
            code=code if isinstance(code, str) else "",
            metadata=msg["metadata"],
            notify=wait.waits,
            arrived=self._clients.arrived.get(str(msg["header"].get("msg_id", ""))),
            retry_of=retry_of,
        )

    async def _execute_on(
        self, idents: list[bytes], msg: _wire.Msg, index: int, plan: CellPlan
    ) -> str | None:
        """The reply's status, or ``None`` if the replica's claim lost (nothing ran)."""

        async def relay(reply: _wire.Msg) -> bool:
            if protocol.claim_lost(reply["metadata"]):
                return False
            self._cells.ran_on(plan.replica)
            await self._clients.send(self._clients.shell, reply, idents)
            return True

        metadata = protocol.cell_metadata(msg["metadata"], index, plan.devices)
        # The front aborts what is queued behind a failed cell (stop_on_error); a replica
        # doing it too would abort the front's next request, sent after the failure.
        content = {**msg["content"], "stop_on_error": False}
        if plan.code is not None:
            content["code"] = plan.code
        pending = await self._relay.roundtrip(
            plan.replica,
            "shell",
            {**msg, "metadata": metadata, "content": content},
            idents,
            grace=IDLE_GRACE_S,
            on_reply=relay,
            on_sent=self._cell_sent,
            needs_quorum=True,
        )
        if pending.reply is None:
            return await self._cell_lost(idents, msg, index, plan.replica)
        if protocol.claim_lost(pending.reply["metadata"]):
            return None
        return str(pending.reply["content"].get("status", "error"))

    def _cell_sent(self, pending: Pending) -> None:
        """The cell is on its way to its replica: an interrupt that came first follows it."""
        cell = self.cell
        if cell is None or not cell.interrupted:
            return
        self._tg.start_soon(
            functools.partial(
                self._relay.control_request,
                pending.target,
                "interrupt_request",
                {},
                timeout=_INTERRUPT_TIMEOUT_S,
                metadata=protocol.interrupt_metadata({}, cell.msg_id),
            )
        )

    async def _cell_lost(
        self, idents: list[bytes], msg: _wire.Msg, index: int, executor: int
    ) -> str:
        """The executor died before replying: have a survivor settle the cell, tell the client."""
        content = await self._cells.lost(index, executor)
        if content["status"] == "error":
            return await self._fail_cell(idents, msg, content)
        await self._clients.reply(idents, msg, "execute_reply", content)
        return str(content["status"])
