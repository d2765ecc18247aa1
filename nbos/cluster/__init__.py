"""Composition: replicated kernels on a cluster, as a library.

:class:`LocalCluster` is the embedded cluster (virtual hosts on this machine);
:func:`connect_blocking` gives the same for synchronous scripts.
"""

from nbos.cluster._blocking import BlockingKernel, BlockingLocalCluster, connect_blocking
from nbos.cluster._kernel import ExecuteResult, Kernel, ReplicaInfo
from nbos.cluster._local import LocalCluster

__all__ = [
    "BlockingKernel",
    "BlockingLocalCluster",
    "ExecuteResult",
    "Kernel",
    "LocalCluster",
    "ReplicaInfo",
    "connect_blocking",
]
