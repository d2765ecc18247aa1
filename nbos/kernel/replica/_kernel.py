"""The replica kernel: an ipykernel that runs a cell only when the kernel's log says so.

Its parts: the executor's path (:mod:`._execution`: claims, the cell bound to its
GPUs, its ``Done``), the applier every replica runs (:mod:`._applier`: committed
entries in log order, rollbacks, snapshot images) and the control requests of the
front (:mod:`._control`). Here they are wired to the kernel's Raft member and
ipykernel's channels; comm messages (widgets) go through the log as state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from typing import Any

from jupyter_client.session import extract_header
from traitlets import Float

from nbos.core.errors import NbosError
from nbos.core.object_store import ObjectStore
from nbos.core.wire.entries import CommEntry
from nbos.gpu import TorchGpuBinder
from nbos.kernel.replica._claims import Claims
from nbos.kernel.replica._control_handlers import ControlHandlers
from nbos.kernel.replica._execution import CellExecution
from nbos.kernel.replica._interrupts import CellInterrupts
from nbos.kernel.replica._machine import KernelStateMachine
from nbos.kernel.replica._member_thread import RaftMemberThread
from nbos.kernel.replica._sync import NamespaceSync
from nbos.kernel.state import UserState

log = logging.getLogger(__name__)

_COMM_TYPES = ("comm_open", "comm_msg", "comm_close")


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


class ReplicaKernel(CellExecution, ControlHandlers):
    """An ``IPythonKernel`` whose cells are ordered and replicated by the kernel's log.

    :meth:`attach` must be called (by :class:`~nbos.kernel.replica.ReplicaApp`)
    before the kernel starts.
    """

    # ipykernel sleeps this long before each execute_reply so that output flushes reach
    # clients first; the front already holds its idle until the replica's idle, which
    # follows all of the cell's output, so the sleep only delays the reply.
    _execute_sleep = Float(0.0)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._init_control()
        comm_handlers = {t: self.shell_handlers[t] for t in _COMM_TYPES}
        for msg_type in _COMM_TYPES:
            self.shell_handlers[msg_type] = self._comm_through_log
        self._raft = None
        self._sync = None
        self._machine = None
        self._namespace_lock = asyncio.Lock()
        self._main_loop = None
        self._init_applier(comm_handlers)
        self._init_execution()
        self._interrupts = CellInterrupts()
        self._binder = TorchGpuBinder(lambda: self._shell.user_ns)
        self._user_names = UserState()

    # --- wiring ------------------------------------------------------------------

    def machine(self) -> KernelStateMachine:
        """The state machine to give the Raft log; its events land on this kernel's loop."""
        self._machine = KernelStateMachine(self._post_event)
        return self._machine

    def attach(self, raft: RaftMemberThread, store: ObjectStore) -> None:
        """Join the kernel's Raft member ``raft``, given :meth:`machine`'s state machine."""
        assert self._machine is not None
        self._raft, self._sync = raft, NamespaceSync(store)
        self._claims = Claims(int(raft.node_id), raft, self._machine)

    def use_virtual_gpus(self) -> None:
        """The host's GPUs are virtual (no CUDA device behind them): a bound cell's
        tensors stay in host memory, and binding, release and eviction go on as for
        real devices."""
        self._binder = TorchGpuBinder(lambda: self._shell.user_ns, target=_host_memory)

    @property
    def _supports_kernel_subshells(self) -> bool:
        # ipykernel decides from ``shell_channel_thread is not None``: see NoShellChannelThread.
        return False

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
        await self._wait_comm(outcome.index)

    # --- process ---------------------------------------------------------------------

    def _process_children(self) -> list[Any]:
        # ipykernel finds the processes to end at shutdown (those a cell started, still in
        # the kernel's process group) by reading every process's /proc entry, in each of
        # its rounds: on a host of hundreds of replicas, deleting many kernels grows with
        # the square of their number. A replica without a child process (most) has no
        # descendant to find, and the kernel says so in one call.
        if not has_child_processes():
            return []
        children: list[Any] = super()._process_children()  # type: ignore[no-untyped-call]
        return children

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        if self._raft is not None:
            await asyncio.to_thread(self._raft.stop)
        result: dict[str, Any] = super().do_shutdown(restart)  # type: ignore[no-untyped-call]
        return result


def has_child_processes() -> bool:
    """Whether this process has a child process, running or not yet reaped (one of any of
    its threads). A descendant whose parent is gone was handed to another process: it is
    no longer this one's, nor ipykernel's to find."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # reaps nothing
    except ChildProcessError:
        return False
    return True


def _host_memory(index: int) -> Any:
    import torch

    return torch.device("cpu")
