"""The replica kernel: an ipykernel that runs a cell only when the kernel's log says so.

The path of one cell on this replica (design: "One cell, end to end"):

1. ``execute_request`` arrives from the front with ``nbos_exec_index`` (and the
   GPU device ids) in its metadata; the replica proposes ``Claim(index, me)``,
   unless its ``Done`` of the cell before claimed the index already.
2. If another replica's claim committed first, it replies ``aborted`` with
   ``nbos.claim_lost_to`` in the metadata and runs nothing.
3. The winner waits until it has applied ``Done(index - 1)``, runs the cell,
   captures what changed and commits ``Done`` with that ``StateDelta`` in it, and
   only then lets the reply go.

Every replica applies committed cells of the others on its main thread (the
applier), in log order, and keeps ``execution_count`` in step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import attrs
from ipykernel.ipkernel import IPythonKernel
from jupyter_client.session import extract_header
from traitlets import Float, Int

from nbos.core.errors import CellLostError, GpuError, KernelError, NbosError
from nbos.core.object_store import ObjectStore
from nbos.core.wire.entries import CellStatus, Claim, CommEntry, Done
from nbos.core.wire.state import StateDelta
from nbos.gpu import TorchGpuBinder
from nbos.kernel.protocol import (
    CELL_STATUS,
    CLAIM_FRESH_S,
    DIGEST_AFTER,
    DIGEST_REQUEST,
    EVICT_DEVICES,
    EVICT_REQUEST,
    EXECUTION_COUNT,
    LAST_DONE,
    LOST_INDEX,
    LOST_REQUEST,
    MEMBER_REQUEST,
    NEXT_CLAIMED_BY,
    PROGRESS_REQUEST,
    REPLY_INFO_KEY,
    cell_request,
    claim_lost_info,
    error_content,
    interrupted_cell,
    reply_of,
)
from nbos.kernel.replica._interrupts import CellInterrupts
from nbos.kernel.replica._machine import (
    CellCommitted,
    CommDelivered,
    Event,
    KernelStateMachine,
    Restored,
)
from nbos.kernel.replica._member_thread import RaftMemberThread
from nbos.kernel.replica._membership import member_reply
from nbos.kernel.replica._output import CellOutput
from nbos.kernel.replica._session import ReplicaSession
from nbos.kernel.replica._sync import NamespaceSync
from nbos.kernel.state import UserState

log = logging.getLogger(__name__)

_COMM_TYPES = ("comm_open", "comm_msg", "comm_close")


def _clock() -> float:
    # Counts the time a process was frozen and a machine suspended: a thawed or resumed
    # replica finds its early claim stale.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@attrs.frozen
class _EarlyClaim:
    """Our claim of cell ``index``, committed with the previous cell's ``Done`` at ``at``."""

    index: int
    at: float

    def fresh(self) -> bool:
        return _clock() - self.at < CLAIM_FRESH_S


@attrs.define
class _Cell:
    index: int
    devices: tuple[int, ...]
    wait_s: float
    started: float = 0.0
    run_s: float = 0.0
    commit_s: float = 0.0
    status: str = ""
    code: str = ""


class NoShellChannelThread:
    """What a replica holds where ipykernel 7 keeps its shell channel thread: none runs.

    ipykernel tests the thread for truth where it wires the shell socket (false: the
    kernel's own thread reads it), and reads ``parent_thread``, the thread cells run on,
    for every cell with a top-level ``await``.
    """

    def __init__(self) -> None:
        self.parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False


class ReplicaKernel(IPythonKernel):
    """An ``IPythonKernel`` whose cells are ordered and replicated by the kernel's log.

    :meth:`attach` must be called (by :class:`~nbos.kernel.replica.ReplicaApp`)
    before the kernel starts.
    """

    rebase_bytes = Int(
        1 << 20, help="Image the namespace for snapshots once this many delta bytes piled up."
    ).tag(config=True)
    # ipykernel sleeps this long before each execute_reply so that output flushes reach
    # clients first; the front already holds its idle until the replica's idle, which
    # follows all of the cell's output, so the sleep only delays the reply.
    _execute_sleep = Float(0.0)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.control_handlers[LOST_REQUEST] = self._lost_request
        self.control_handlers[DIGEST_REQUEST] = self._digest_request
        self.control_handlers[PROGRESS_REQUEST] = self._progress_request
        self.control_handlers[EVICT_REQUEST] = self._evict_request
        self.control_handlers[MEMBER_REQUEST] = self._member_request
        self._comm_handlers = {t: self.shell_handlers[t] for t in _COMM_TYPES}
        for msg_type in _COMM_TYPES:
            self.shell_handlers[msg_type] = self._comm_through_log
        self._raft: RaftMemberThread | None = None
        self._sync: NamespaceSync | None = None
        self._machine: KernelStateMachine | None = None
        # Held while a cell runs and while the namespace is imaged for a snapshot.
        self._namespace_lock = asyncio.Lock()
        self._main_loop: asyncio.AbstractEventLoop | None = None
        #: Applied entries' events, appended by the Raft thread, applied on the loop.
        self._inbox: deque[Event] = deque()
        self._arrived = asyncio.Event()
        #: Held while events are applied (by the applier, or by a cell, see _own_done).
        self._applying = asyncio.Lock()
        self._applied_done = 0
        self._applied_comm = 0
        self._applied_changed = asyncio.Event()
        self._cell: _Cell | None = None
        #: The cell whose user code ran here and whose ``Done`` has not applied yet: the
        #: namespace holds its changes, which count only if that Done is ours.
        self._dirty: int | None = None
        #: The committed state to go back to, once the dirty cell's index went to a
        #: ``Done`` other than ours (it was declared lost).
        self._rollback: Restored | None = None
        #: The running cell lost its index to such a ``Done``.
        self._diverged = False
        self._interrupts = CellInterrupts()
        self._warned: set[str] = set()
        self._binder = TorchGpuBinder(lambda: self._shell.user_ns)
        self._early: _EarlyClaim | None = None
        self._user_names = UserState()

    # --- wiring ------------------------------------------------------------------

    def machine(self) -> KernelStateMachine:
        """The state machine to give the Raft log; its events land on this kernel's loop."""
        self._machine = KernelStateMachine(self._post_event)
        return self._machine

    def attach(self, raft: RaftMemberThread, store: ObjectStore) -> None:
        self._raft, self._sync = raft, NamespaceSync(store)

    def use_virtual_gpus(self) -> None:
        """The host's GPUs are virtual (no CUDA device behind them): a bound cell's
        tensors stay in host memory, and binding, release and eviction go on as for
        real devices."""
        self._binder = TorchGpuBinder(lambda: self._shell.user_ns, target=_host_memory)

    @property
    def _supports_kernel_subshells(self) -> bool:
        # ipykernel decides from ``shell_channel_thread is not None``: see NoShellChannelThread.
        return False

    @property
    def _shell(self) -> Any:
        assert self.shell is not None
        return self.shell

    @property
    def _session(self) -> ReplicaSession:
        assert isinstance(self.session, ReplicaSession)
        return self.session

    @property
    def node(self) -> int:
        assert self._raft is not None
        return int(self._raft.node_id)

    def start(self) -> None:
        super().start()  # type: ignore[no-untyped-call]
        self._main_loop = asyncio.get_event_loop()
        self._main_loop.create_task(self._apply_events())
        assert self._raft is not None
        self._raft.start()

    async def dispatch_shell(self, msg: Any, /, *args: Any, **kwargs: Any) -> None:
        # A request to an idle kernel: its Raft group may be quiesced, and this replica
        # must time its leader again (it may be gone) before a cell needs a leader.
        if self._raft is not None:
            self._raft.wake()
        await super().dispatch_shell(msg, *args, **kwargs)

    async def dispatch_control(self, msg: Any) -> None:
        if self._raft is not None:
            self._raft.wake()
        await super().dispatch_control(msg)  # type: ignore[no-untyped-call]

    def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
        # The front publishes its own busy for every request and reads a replica's idle
        # only to know that everything of the request is out: a busy would cost a
        # message on each hop, and the kernel's thread, for nothing.
        if status == "busy":
            return
        if status == "idle":
            # A cell's reply waits for this moment: see ReplicaSession.
            request = extract_header(parent or self.get_parent(channel))  # type: ignore[no-untyped-call]
            if isinstance(request.get("msg_id"), str):
                self._session.release(request["msg_id"])
        super()._publish_status(status, channel, parent)  # type: ignore[no-untyped-call]

    def _post_event(self, event: Event) -> None:
        # Called on the Raft thread: hand the event to the kernel's own loop.
        assert self._main_loop is not None
        self._inbox.append(event)
        self._main_loop.call_soon_threadsafe(self._arrived.set)

    # --- the executor's path -------------------------------------------------------

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
            claim = await self._claim(index)
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
            self._cell = _Cell(index, devices, wait_s=waited)
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

    async def _claim(self, index: int) -> int:
        """The replica whose claim of cell ``index`` committed first (maybe ours, made early)."""
        early, self._early = self._early, None
        if early is not None and early.index == index:
            return await self._still_ours(early)
        # A claim committed now is its own barrier: had a Done for the index committed
        # before it, the claim would have lost.
        return await self._propose_claim(index)

    async def _still_ours(self, early: _EarlyClaim) -> int:
        """Our early claim, checked against the log as of now: ``-1`` if it was lost.

        Since it committed, the front may have had the index settled as lost (this
        replica was frozen or cut off meanwhile), and a lost cell must never run. Unless
        the claim is fresh (:data:`CLAIM_FRESH_S`), a read barrier makes this replica
        apply what committed until now before it looks.
        """
        assert self._raft is not None and self._machine is not None
        if not early.fresh():
            await self._raft.caught_up()
        if self._machine.claim_stands(early.index, self.node):
            return self.node
        log.warning("cell %d was settled without this replica; it does not run", early.index)
        return -1

    async def _propose_claim(self, index: int) -> int:
        assert self._raft is not None
        outcome = await self._raft.propose(Claim(index, self.node))
        return outcome.winner

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
        self, cell: _Cell, run: Coroutine[Any, Any, dict[str, Any]]
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

    async def _commit(self, cell: _Cell) -> None:
        assert self._raft is not None and self._sync is not None
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
            self._early = _EarlyClaim(cell.index + 1, _clock())
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

    # --- every replica's path ---------------------------------------------------------

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

    # --- comms: state, so they go through the log ------------------------------------

    async def _comm_through_log(self, stream: Any, ident: Any, msg: dict[str, Any]) -> None:
        assert self._raft is not None
        message = {k: msg.get(k, {}) for k in ("header", "parent_header", "metadata", "content")}
        buffers = [bytes(b) for b in msg.get("buffers", [])]
        entry = CommEntry(self.node, json.dumps(message, default=str).encode(), buffers)
        try:
            outcome = await self._raft.propose(entry)
        except NbosError as exc:
            log.warning("comm message not replicated: %s", exc)
            return
        # Handle it here before this request's idle goes out: the front relays the
        # handler's output only while the request is in flight.
        while self._applied_comm < outcome.index:
            await self._applied_changed.wait()

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

    # --- control requests from the front -------------------------------------------

    async def _lost_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Commit ``Done(index, lost)`` for a cell whose executor died; reply what counts."""
        assert self._raft is not None
        content: dict[str, Any]
        try:
            index = int(parent["content"][LOST_INDEX])
            done = Done(index, self.node, int(self._shell.execution_count), "lost")
            outcome = await self._raft.propose(done)
            content = {
                "status": "ok",
                CELL_STATUS: outcome.status,
                EXECUTION_COUNT: outcome.execution_count,
            }
        except (KeyError, TypeError, ValueError, NbosError) as exc:
            log.warning("nbos_lost_request failed: %s", exc)
            content = error_content(exc, self.execution_count)
        self._session.send(stream, reply_of(LOST_REQUEST), content, parent, ident=ident)

    async def _progress_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Reply where the kernel's cells stand, as committed when the request came: the
        last ``Done``'s cell and who claimed the cell after it (a front taking over)."""
        assert self._raft is not None and self._machine is not None
        content: dict[str, Any]
        try:
            await self._raft.caught_up()
        except NbosError as exc:
            log.warning("nbos_progress_request failed: %s", exc)
            content = error_content(exc, self.execution_count)
        else:
            done, claimed_by = self._machine.progress()
            content = {"status": "ok", LAST_DONE: done, NEXT_CLAIMED_BY: claimed_by}
        self._session.send(stream, reply_of(PROGRESS_REQUEST), content, parent, ident=ident)

    async def _digest_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Reply the namespace digest once the cell ``after`` (default: none) has applied."""
        assert self._main_loop is not None
        content: dict[str, Any]
        try:
            after = int(parent["content"].get(DIGEST_AFTER, 0))
        except (TypeError, ValueError) as exc:
            log.warning("nbos_digest_request refused: %s", exc)
            content = error_content(exc, self.execution_count)
        else:
            future = asyncio.run_coroutine_threadsafe(self._digest_after(after), self._main_loop)
            digest, done = await asyncio.wrap_future(future)
            content = {"status": "ok", "digest": digest, "applied_done": done}
        self._session.send(stream, reply_of(DIGEST_REQUEST), content, parent, ident=ident)

    async def _digest_after(self, index: int) -> tuple[str, int]:
        await self._wait_done(index)
        assert self._sync is not None
        return self._sync.digest(self._user_state()), self._applied_done

    def _user_state(self) -> dict[str, Any]:
        # IPython seeds user_ns with helpers of its own (``open``, ``exit`` ...) and lists
        # them in user_ns_hidden: each replica has its own, so they are not user state.
        return self._user_names.of(self._shell.user_ns, self._shell.user_ns_hidden)

    async def _evict_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Move tensors left resident on GPUs to host memory (the host needs the devices).

        ``devices`` in the content, if given, names the devices the host needs.
        """
        assert self._main_loop is not None
        devices = parent.get("content", {}).get(EVICT_DEVICES)
        needed = (
            tuple(devices)
            if isinstance(devices, list) and all(isinstance(d, int) for d in devices)
            else None
        )
        future = asyncio.run_coroutine_threadsafe(self._evict(needed), self._main_loop)
        content: dict[str, Any] = {"status": "ok"}
        try:
            await asyncio.wrap_future(future)
        except Exception as exc:
            log.exception("eviction failed")
            content = error_content(exc, self.execution_count)
        self._session.send(stream, reply_of(EVICT_REQUEST), content, parent, ident=ident)

    async def _evict(self, needed: tuple[int, ...] | None) -> None:
        # A cell binds all of our tensors onto its own devices: if none of ours is on a
        # needed device, there is nothing to move and no running cell to wait for.
        if needed is not None and not set(needed) & set(self._binder.resident):
            return
        # Not while a cell uses the devices: the namespace lock is held during cells.
        async with self._namespace_lock:
            await self._binder.evict()

    async def _member_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Change the kernel's Raft membership (see :func:`member_reply`)."""
        assert self._raft is not None
        content = await member_reply(self._raft, parent["content"])
        self._session.send(stream, reply_of(MEMBER_REQUEST), content, parent, ident=ident)

    # --- process ---------------------------------------------------------------------

    async def interrupt_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        # Only this process is signalled: the base class signals the whole process group,
        # which could hold other replicas.
        cell = interrupted_cell(parent.get("metadata"))
        self._interrupts.interrupt(cell, lambda: os.kill(os.getpid(), signal.SIGINT))
        self._session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        if self._raft is not None:
            await asyncio.to_thread(self._raft.stop)
        result: dict[str, Any] = super().do_shutdown(restart)  # type: ignore[no-untyped-call]
        return result


def _host_memory(index: int) -> Any:
    import torch

    return torch.device("cpu")
