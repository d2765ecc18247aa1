"""The replica kernel process: an ipykernel joined to its kernel's Raft group.

Launched as ``python -m nbos.kernel.replica`` (see :class:`ReplicaApp`). The front
talks to it over the Jupyter protocol, with the additions of
:mod:`nbos.kernel.protocol`: the ``execute_request`` metadata keys
:data:`EXEC_INDEX_KEY` and :data:`DEVICES_KEY`, and the control requests
``nbos_lost_request`` (commit ``Done(index, lost)``), ``nbos_digest_request``
(namespace digest once a cell has applied), ``nbos_progress_request`` (the last
committed ``Done`` and the next cell's claimant, for a front that takes a kernel
over), ``nbos_evict_request`` (GPU tensors to host memory) and
``nbos_member_request`` (a Raft membership change, for replacing a dead replica).
"""

from nbos.kernel.protocol import DEVICES_KEY, EXEC_INDEX_KEY, error_content
from nbos.kernel.replica._app import ReplicaApp, parse_peers
from nbos.kernel.replica._kernel import ReplicaKernel
from nbos.kernel.replica._machine import KernelStateMachine, Outcome
from nbos.kernel.replica._member_thread import RaftMemberThread, peer_id

__all__ = [
    "DEVICES_KEY",
    "EXEC_INDEX_KEY",
    "KernelStateMachine",
    "Outcome",
    "RaftMemberThread",
    "ReplicaApp",
    "ReplicaKernel",
    "error_content",
    "parse_peers",
    "peer_id",
]
