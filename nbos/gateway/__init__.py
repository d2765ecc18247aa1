"""The gateway: every kernel of a cluster, its hosts and its GPUs (``docs/architecture.md``).

* :class:`KernelManager` starts, restores, replaces and shuts down replicated kernels
  (each a :class:`Kernel` handle) over a :class:`ReplicaLauncher`; the embedded
  :class:`~nbos.cluster.LocalCluster` and the ``nbos gateway`` daemon both run it; a
  kernel's :class:`KernelState` is decided in one place (``Kernel.state``);
* :class:`GpuScheduler` places kernels' replicas and grants GPUs to cells through
  the host agents (:mod:`nbos.agent`); see ``docs/placement.md``.
* :class:`HostDirectory` registers ``nbos agent`` daemons (CURVE), watches their
  heartbeats and feeds the scheduler; :class:`AgentBackend` starts processes
  through them (``docs/deploy.md``).
* :mod:`nbos.gateway.requests` works out how many GPUs a cell asks for.
"""

from nbos.core.replica_launcher import AdoptingLauncher, ReplicaLauncher
from nbos.gateway._agent_backend import (
    HOST_LOST_STATUS,
    UNKNOWN_STATUS,
    AgentBackend,
    AgentProcessHandle,
)
from nbos.gateway._cluster_gpus import ClusterGpus, Eviction
from nbos.gateway._directory import HostDirectory, HostListener, RegisteredHost
from nbos.gateway._hosts import Grant, HostRecord
from nbos.gateway._kernel import Kernel, ReplicaInfo
from nbos.gateway._kernel_manager import KernelManager, KernelOptions
from nbos.gateway._kernel_state import KERNEL_STATES, KernelState
from nbos.gateway._launch import LocalLauncher
from nbos.gateway._scheduler import CellLease, GpuScheduler, MoveHold, WaitCallback

__all__ = [
    "HOST_LOST_STATUS",
    "KERNEL_STATES",
    "UNKNOWN_STATUS",
    "AdoptingLauncher",
    "AgentBackend",
    "AgentProcessHandle",
    "CellLease",
    "ClusterGpus",
    "Eviction",
    "GpuScheduler",
    "Grant",
    "HostDirectory",
    "HostListener",
    "HostRecord",
    "Kernel",
    "KernelManager",
    "KernelOptions",
    "KernelState",
    "LocalLauncher",
    "MoveHold",
    "RegisteredHost",
    "ReplicaInfo",
    "ReplicaLauncher",
    "WaitCallback",
]
