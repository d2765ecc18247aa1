"""The applier: every replica applies the kernel's committed entries on its kernel's loop.

Entries apply in log order: other replicas' cells (their deltas, ``execution_count``
and history), snapshots, and comm messages (widgets), which are state too, so every
replica dispatches them from the log. The executor's own cells are in its namespace
already; a cell that ran here but whose index went to another ``Done`` (it was
declared lost) is rolled back to the committed state. Once enough deltas piled up
on the last namespace image, the namespace is imaged again for Raft snapshots.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from traitlets import Int

from nbos.core.errors import NbosError
from nbos.kernel.replica._kernel_base import KernelBase
from nbos.kernel.replica._machine import CellCommitted, CommDelivered, Event, Restored

log = logging.getLogger(__name__)

#: A comm message's handler, as ipykernel calls it: ``handler(stream, idents, msg)``.
CommHandler = Callable[[Any, list[bytes], dict[str, Any]], Any]


class Applier(KernelBase):
    """The replica kernel's applier (see the module doc)."""

    rebase_bytes = Int(
        1 << 20, help="Image the namespace for snapshots once this many delta bytes piled up."
    ).tag(config=True)

    def _init_applier(self, comm_handlers: dict[str, CommHandler]) -> None:
        """Start with nothing applied; comm messages go to ``comm_handlers`` by type."""
        self._comm_handlers = comm_handlers
        #: Applied entries' events, appended by the Raft thread, applied on the loop.
        self._inbox: deque[Event] = deque()
        self._arrived = asyncio.Event()
        #: Held while events are applied (by the applier, or by a cell, see _own_done).
        self._applying = asyncio.Lock()
        self._applied_done = 0
        self._applied_comm = 0
        self._applied_changed = asyncio.Event()
        self._dirty = None
        #: The committed state to go back to, once the dirty cell's index went to a
        #: ``Done`` other than ours (it was declared lost).
        self._rollback: Restored | None = None

    def _post_event(self, event: Event) -> None:
        # Called on the Raft thread: hand the event to the kernel's own loop.
        assert self._main_loop is not None
        self._inbox.append(event)
        self._main_loop.call_soon_threadsafe(self._arrived.set)

    async def _wait_comm(self, index: int) -> None:
        while self._applied_comm < index:
            await self._applied_changed.wait()

    async def _wait_done(self, index: int) -> None:
        while self._applied_done < index:
            await self._applied_changed.wait()

    async def _own_done_applied(self, index: int) -> None:
        """Wait until our committed ``Done`` of cell ``index`` applied here.

        If it is next in line, the cell's own task applies it: the cell's changes are in
        the namespace already, so that only moves the watermark, and waiting for the
        applier task would add turns of the loop to every cell's reply.
        """
        event = self._inbox[0] if self._inbox and not self._applying.locked() else None
        # Only a Done that counts: any other asks for a rollback, which needs the
        # namespace lock that the cell holds.
        if isinstance(event, CellCommitted) and (
            (event.exec_index, event.replica, event.counts) == (index, self.node, True)
        ):
            async with self._applying:
                await self._apply_next(self._inbox.popleft())
        await self._wait_done(index)

    async def _apply_events(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            async with self._applying:
                while self._inbox:
                    await self._apply_next(self._inbox.popleft())
            await self._maybe_rebase()

    async def _apply_next(self, event: Event) -> None:
        try:
            await self._apply_event(event)
        except Exception:
            # A delta that cannot apply must not stop the applier: later cells still
            # need their Done to be seen. The namespace digest shows the divergence.
            log.exception("applying %s failed", type(event).__name__)
        if self._rollback is not None:
            # Before the watermark moves: nothing may see or build on the old state.
            await self._roll_back(self._rollback)
        if isinstance(event, CommDelivered):
            self._applied_comm = event.index
        else:
            self._applied_done = (
                event.exec_index if isinstance(event, CellCommitted) else event.last_done
            )
        # Wake every waiter; each re-checks its own watermark.
        self._applied_changed.set()
        self._applied_changed = asyncio.Event()

    async def _roll_back(self, committed: Restored) -> None:
        """Make the namespace the kernel's committed state (a snapshot, or the state a
        cell that ran here but lost its index started from).

        Waits for a running cell to end (it holds the namespace lock; a cell whose Done
        was refused does not wait for the applier). Later entries wait for this, so they
        apply on the committed state, as on every other replica.
        """
        assert self._sync is not None
        async with self._namespace_lock:
            self._rollback = None
            try:
                await self._restore(committed)
                # What the last capture remembered may no longer be in the namespace.
                await self._sync.baseline(self._shell.user_ns)
            except Exception:
                log.exception("restoring the state of cell %d failed", committed.last_done)
            else:
                log.info("namespace set to the committed state of cell %d", committed.last_done)

    async def _maybe_rebase(self) -> None:
        """Image the namespace for Raft snapshots once enough deltas piled up on the last one."""
        assert self._machine is not None and self._sync is not None
        if self._inbox or self._machine.replay_bytes < self.rebase_bytes:
            return
        async with self._namespace_lock:
            if self._dirty is not None:
                return  # a cell's changes are in it that may not count
            cell = self._applied_done
            try:
                image = await self._sync.image(self._user_state())
            except NbosError as exc:
                log.warning("namespace image for snapshots failed: %s", exc)
                return
        self._machine.rebase(cell, image)

    async def _apply_event(self, event: Event) -> None:
        assert self._sync is not None
        user_ns = self._shell.user_ns
        if isinstance(event, CellCommitted):
            # Only the process that ran the cell has its changes already: a replica
            # replaying its own log after a restart applies its own cells too.
            ran_here = self._dirty == event.exec_index
            if ran_here:
                self._dirty = None
                if not (event.counts and event.replica == self.node):
                    self._lost_here(event)
            elif event.state is not None:
                await self._sync.apply(user_ns, event.state)
            if not ran_here and event.code:
                # The cell's number is the one before the counter it left behind.
                self._shell.history_manager.store_inputs(event.execution_count - 1, event.code)
            self._shell.execution_count = event.execution_count
        elif isinstance(event, Restored):
            self._restore_snapshot(event)
        else:
            self._dispatch_comm(event)

    def _lost_here(self, event: CellCommitted) -> None:
        """Cell ``event.exec_index`` ran here, and another ``Done`` than ours settled it
        (declared lost while this replica was thought dead or cut off): its changes
        are in our namespace only. Roll back, after the cell if it still runs."""
        running = self._cell
        if running is not None and running.index == event.exec_index:
            self._diverged = True
        log.warning(
            "cell %d ran here but was settled as %s: its changes are undone",
            event.exec_index,
            event.status,
        )
        self._rollback = event.committed

    def _restore_snapshot(self, snapshot: Restored) -> None:
        log.info("restoring the namespace from a snapshot (last cell %d)", snapshot.last_done)
        dirty = self._dirty
        if dirty is None or snapshot.last_done >= dirty:
            # The snapshot settled the cell that ran here (if any) either way: take it,
            # after that cell ends.
            self._dirty, self._rollback = None, snapshot
        # Else it is the state the running cell started from, which the namespace has.

    async def _restore(self, state: Restored) -> None:
        assert self._sync is not None
        user_ns = self._shell.user_ns
        await self._sync.restore(user_ns, state.namespace)
        for delta in state.deltas:
            await self._sync.apply(user_ns, delta)
        self._shell.execution_count = state.execution_count

    def _dispatch_comm(self, event: CommDelivered) -> None:
        try:
            msg = json.loads(event.message)
            handler = self._comm_handlers[msg["header"]["msg_type"]]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad comm entry ignored: %s", exc)
            return
        msg["buffers"] = [memoryview(b) for b in event.buffers]
        # What the handler sends (comm.send) names the client's message as its parent.
        self.set_parent([], msg, channel="shell")  # type: ignore[no-untyped-call]
        handler(self.shell_stream, [], msg)
