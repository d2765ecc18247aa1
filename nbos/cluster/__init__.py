"""Composition: replicated kernels on a cluster, as a library.

:class:`Gateway` runs every kernel of a cluster over any replica launcher;
:class:`LocalCluster` is the embedded cluster (the same gateway over virtual hosts on
this machine);
:func:`connect_blocking` gives the same for synchronous scripts.
"""

from nbos.cluster._blocking import BlockingKernel, BlockingLocalCluster, connect_blocking
from nbos.cluster._gateway import Gateway, KernelOptions
from nbos.cluster._kernel import ExecuteResult, Kernel, ReplicaInfo
from nbos.cluster._local import LocalCluster

__all__ = [
    "BlockingKernel",
    "BlockingLocalCluster",
    "ExecuteResult",
    "Gateway",
    "Kernel",
    "KernelOptions",
    "LocalCluster",
    "ReplicaInfo",
    "connect_blocking",
]
