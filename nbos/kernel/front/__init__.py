"""The kernel front: one Jupyter kernel in front of a kernel's replicas.

See :class:`KernelFront`; :class:`ExecutorChooser` (from ``nbos.core``) is where GPU-aware
scheduling plugs in.
"""

from nbos.core.executor_chooser import CellPlan, ChoiceRequest, ExecutorChooser
from nbos.kernel.front._chooser import LastExecutorChooser
from nbos.kernel.front._clients import FrontIdentity
from nbos.kernel.front._front import CellActivity, KernelFront
from nbos.kernel.front._liveness import HeartbeatPolicy
from nbos.kernel.front._upstream import ReplicaEndpoint

__all__ = [
    "CellActivity",
    "CellPlan",
    "ChoiceRequest",
    "ExecutorChooser",
    "FrontIdentity",
    "HeartbeatPolicy",
    "KernelFront",
    "LastExecutorChooser",
    "ReplicaEndpoint",
]
