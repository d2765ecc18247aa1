"""The embedded cluster: replicated kernels on virtual hosts of this machine, as a library.

:class:`LocalCluster` runs the gateway's own :class:`~nbos.gateway.KernelManager` over
local agents (one code path from a laptop to many servers);
:func:`connect_blocking` gives the same for synchronous scripts; :class:`CellClient` runs
cells on any kernel by its connection info (one of a ``nbos gateway``).
"""

from nbos.cluster._blocking import BlockingKernel, BlockingLocalCluster, connect_blocking
from nbos.cluster._local import LocalCluster
from nbos.gateway import Kernel, KernelManager, KernelOptions, ReplicaInfo
from nbos.kernel.client import CellClient, ExecuteResult

__all__ = [
    "BlockingKernel",
    "BlockingLocalCluster",
    "CellClient",
    "ExecuteResult",
    "Kernel",
    "KernelManager",
    "KernelOptions",
    "LocalCluster",
    "ReplicaInfo",
    "connect_blocking",
]
