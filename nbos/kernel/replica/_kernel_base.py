"""What the parts of the replica kernel share: its Raft member, its namespace, its session.

:class:`~nbos.kernel.replica._kernel.ReplicaKernel` is an ``IPythonKernel`` made of
parts that act on one namespace under one lock and override ipykernel's own steps,
so they are classes over this base rather than objects of their own: the applier
(:mod:`._applier`), the executor's path (:mod:`._execution`) and the control
handlers (:mod:`._control`). The kernel sets every attribute declared here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
from ipykernel.ipkernel import IPythonKernel

from nbos.gpu import TorchGpuBinder
from nbos.kernel.replica._interrupts import CellInterrupts
from nbos.kernel.replica._machine import KernelStateMachine
from nbos.kernel.replica._member_thread import RaftMemberThread
from nbos.kernel.replica._session import ReplicaSession
from nbos.kernel.replica._sync import NamespaceSync
from nbos.kernel.state import UserState


@attrs.define
class RunningCell:
    """The cell this replica runs: its index, its GPUs, and how long each step took."""

    index: int
    devices: tuple[int, ...]
    wait_s: float
    started: float = 0.0
    run_s: float = 0.0
    commit_s: float = 0.0
    status: str = ""
    code: str = ""


class KernelBase(IPythonKernel):
    """The state the parts of a replica kernel share (see the module doc)."""

    _raft: RaftMemberThread | None
    _sync: NamespaceSync | None
    _machine: KernelStateMachine | None
    _main_loop: asyncio.AbstractEventLoop | None
    #: Held while a cell runs and while the namespace is imaged for a snapshot.
    _namespace_lock: asyncio.Lock
    _binder: TorchGpuBinder
    _interrupts: CellInterrupts
    _user_names: UserState
    _cell: RunningCell | None
    #: The cell whose user code ran here and whose ``Done`` has not applied yet: the
    #: namespace holds its changes, which count only if that Done is ours.
    _dirty: int | None
    #: The running cell lost its index to a ``Done`` other than ours.
    _diverged: bool

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

    def _user_state(self) -> dict[str, Any]:
        # IPython seeds user_ns with helpers of its own (``open``, ``exit`` ...) and lists
        # them in user_ns_hidden: each replica has its own, so they are not user state.
        return self._user_names.of(self._shell.user_ns, self._shell.user_ns_hidden)
