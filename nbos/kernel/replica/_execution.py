"""The executor's path: a replica runs a cell only when the kernel's log says so.

The path of one cell on this replica (design: "One cell, end to end"):

1. ``execute_request`` arrives from the front with ``nbos_exec_index`` (and the
   GPU device ids) in its metadata; the replica proposes ``Claim(index, me)``,
   unless its ``Done`` of the cell before claimed the index already (:mod:`._claims`).
2. If another replica's claim committed first, it replies ``aborted`` with
   ``nbos.claim_lost_to`` in the metadata and runs nothing.
3. The winner waits until it has applied ``Done(index - 1)``, runs the cell bound to
   its GPUs, captures what changed and commits ``Done`` with that ``StateDelta`` in
   it, and only then lets the reply go. A ``Done`` refused (the cell was declared
   lost meanwhile) leaves the cell *diverged*: the applier rolls its changes back.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Coroutine
from typing import Any

from nbos.core.errors import CellLostError, GpuError, KernelError, NbosError
from nbos.core.wire.entries import CellStatus, Done
from nbos.core.wire.state import StateDelta
from nbos.kernel.protocol import REPLY_INFO_KEY, cell_request, claim_lost_info, error_content
from nbos.kernel.replica._applier import Applier
from nbos.kernel.replica._claims import Claims
from nbos.kernel.replica._kernel_base import RunningCell
from nbos.kernel.replica._output import CellOutput

log = logging.getLogger(__name__)


class CellExecution(Applier):
    """The replica kernel's executor path (see the module doc)."""

    def _init_execution(self) -> None:
        self._claims: Claims | None = None
        self._cell = None
        self._diverged = False
        #: Names already reported as staying on this replica (unpicklable).
        self._warned: set[str] = set()

    async def execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        msg_id = str(parent["header"]["msg_id"])
        self._interrupts.request_began(msg_id)
        try:
            await self._execute_request(stream, ident, parent)
        finally:
            self._interrupts.request_ended(msg_id)

    async def _execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        try:
            index, devices = cell_request(parent.get("metadata"))
        except KernelError as exc:
            log.warning("execute_request refused: %s", exc)
            self._reply_error(stream, ident, parent, exc)
            return
        begun = time.monotonic()
        try:
            assert self._claims is not None
            claim = await self._claims.claim(index)
        except NbosError as exc:
            log.warning("claim of cell %d failed: %s", index, exc)
            self._reply_error(stream, ident, parent, exc)
            return
        if claim != self.node:
            self._reply_aborted(stream, ident, parent, claim_lost_info(claim))
            return
        await self._wait_done(index - 1)
        waited = time.monotonic() - begun
        async with self._namespace_lock:
            if self._applied_done >= index:
                # A survivor declared this cell lost while we waited: it must not run.
                self._reply_error(stream, ident, parent, CellLostError(index, self.node))
                return
            self._cell = RunningCell(index, devices, wait_s=waited)
            self._dirty, self._diverged = index, False
            try:
                await super().execute_request(stream, ident, parent)  # type: ignore[no-untyped-call]
            finally:
                self._cell = None
        assert self._raft is not None
        if self._diverged:
            # The applier rolls the namespace back as soon as the lock is free.
            log.error("cell %d was declared lost while it ran here; its changes are undone", index)
        else:
            self._raft.want_leadership()

    async def do_execute(
        self,
        code: str,
        silent: bool,
        store_history: bool = True,
        user_expressions: dict[str, Any] | None = None,
        allow_stdin: bool = False,
        *,
        cell_meta: dict[str, Any] | None = None,
        cell_id: str | None = None,
    ) -> dict[str, Any]:
        cell = self._cell
        if cell is None:
            raise KernelError("do_execute outside a claimed cell")
        cell.started = time.monotonic()
        try:
            reply = await self._run_bound(
                cell,
                super().do_execute(  # type: ignore[no-untyped-call]
                    code,
                    silent,
                    store_history,
                    user_expressions,
                    allow_stdin,
                    cell_meta=cell_meta,
                    cell_id=cell_id,
                ),
            )
            cell.run_s = time.monotonic() - cell.started
            cell.status = "ok" if reply.get("status") == "ok" else "error"
            cell.code = code if store_history and not silent else ""
            try:
                await self._commit(cell)
                cell.commit_s = time.monotonic() - cell.started - cell.run_s
            except NbosError as exc:
                log.warning("cell %d could not be committed: %s", cell.index, exc)
                return error_content(exc, self.execution_count)
        finally:
            # Lazy eviction: tensors stay on the devices until the host needs them
            # (nbos_evict_request), so a kernel that runs there again pays nothing.
            await self._binder.release(evict=False)
        if self._diverged:
            return error_content(CellLostError(cell.index, self.node), self.execution_count)
        return reply

    async def _run_bound(
        self, cell: RunningCell, run: Coroutine[Any, Any, dict[str, Any]]
    ) -> dict[str, Any]:
        """Bind the cell's GPUs (bringing resident tensors onto them), then ``run`` it."""
        try:
            await self._binder.bind(cell.devices)
        except Exception as exc:
            run.close()
            # A failed bind leaves nothing bound (TorchGpuBinder); the cell does not
            # run, and its Done (status error) still commits so later cells go on.
            log.exception("binding GPUs %s for cell %d failed", cell.devices, cell.index)
            return error_content(GpuError(f"cannot bind GPUs {list(cell.devices)}: {exc}"), 0)
        try:
            if not self._interrupts.enter_user_code():
                # Interrupted while it was claimed or waited for the cell before it: it does
                # not run, and its Done (status error) still commits so later cells go on.
                run.close()
                return error_content(KeyboardInterrupt("interrupted before the cell started"), 0)
            # The cell's processes print on its own descriptors, never into later cells.
            with CellOutput():
                return await run
        except KeyboardInterrupt:
            # The interrupt landed in IPython's own steps around the user's code, which
            # let it through: the cell ends interrupted, the process must not.
            run.close()
            return error_content(KeyboardInterrupt("interrupted"), self.execution_count)
        finally:
            self._interrupts.leave_user_code()

    async def _commit(self, cell: RunningCell) -> None:
        assert self._raft is not None and self._sync is not None and self._claims is not None
        delta = await self._sync.capture(self._user_state(), cell.index)
        self._tell_unpicklable(delta)
        state = delta if await self._sync.changes_anything(delta) else None
        status: CellStatus = "ok" if cell.status == "ok" else "error"
        count = int(self._shell.execution_count)
        # The front sends a kernel's cells to its last executor while it lives: this
        # Done claims the next cell too, so that cell's claim needs no round of its own.
        done = Done(cell.index, self.node, count, status, cell.code, state, claim_next=True)
        outcome = await self._raft.propose(done)
        if outcome.accepted and outcome.winner == self.node:
            self._claims.claimed_next(cell.index + 1)
        if not outcome.accepted:
            # Another Done for the index committed first (the cell was declared lost):
            # the applier rolls our changes back once this cell ends.
            self._diverged = True
            return
        await self._own_done_applied(cell.index)

    def _tell_unpicklable(self, delta: StateDelta) -> None:
        fresh = [(name, why) for name, why in delta.unpicklable if name not in self._warned]
        if not fresh:
            return
        self._warned.update(name for name, _ in fresh)
        lines = "".join(f"  {name}: {why}\n" for name, why in fresh)
        sys.stderr.write(
            "nbos: these names cannot be replicated and stay on this replica only "
            f"(lost if it fails):\n{lines}"
        )
        sys.stderr.flush()

    def finish_metadata(
        self, parent: dict[str, Any], metadata: dict[str, Any], reply_content: dict[str, Any]
    ) -> dict[str, Any]:
        metadata = super().finish_metadata(parent, metadata, reply_content)  # type: ignore[no-untyped-call]
        cell = self._cell
        if cell is not None:
            metadata[REPLY_INFO_KEY] = {
                "exec_index": cell.index,
                "replica": self.node,
                "devices": list(cell.devices),
                "wait_s": cell.wait_s,
                "run_s": cell.run_s,
                "commit_s": cell.commit_s,
                "raft_leader": self._raft.leader_id if self._raft is not None else None,
            }
        return metadata

    def _reply_aborted(
        self, stream: Any, ident: Any, parent: dict[str, Any], info: dict[str, Any]
    ) -> None:
        content = {"status": "aborted", "execution_count": self.execution_count}
        self._session.send(
            stream, "execute_reply", content, parent, metadata={REPLY_INFO_KEY: info}, ident=ident
        )

    def _reply_error(self, stream: Any, ident: Any, parent: dict[str, Any], exc: Exception) -> None:
        content = error_content(exc, self.execution_count)
        self._session.send(stream, "execute_reply", content, parent, ident=ident)
