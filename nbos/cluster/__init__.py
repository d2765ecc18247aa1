"""Composition: replicated kernels on a cluster, as a library.

:class:`Gateway` runs every kernel of a cluster over any replica launcher;
:class:`LocalCluster` is the embedded cluster (the same gateway over virtual hosts on
this machine);
:func:`connect_blocking` gives the same for synchronous scripts; :class:`CellClient` runs
cells on any kernel by its connection info (one of a ``nbos gateway``).
"""

from nbos.cluster._blocking import BlockingKernel, BlockingLocalCluster, connect_blocking
from nbos.cluster._cells import CellClient, ExecuteResult
from nbos.cluster._gateway import Gateway, KernelOptions
from nbos.cluster._kernel import Kernel, ReplicaInfo
from nbos.cluster._local import LocalCluster

__all__ = [
    "BlockingKernel",
    "BlockingLocalCluster",
    "CellClient",
    "ExecuteResult",
    "Gateway",
    "Kernel",
    "KernelOptions",
    "LocalCluster",
    "ReplicaInfo",
    "connect_blocking",
]
