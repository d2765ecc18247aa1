"""The bottom layer: ids, errors, config, the wire format and the interfaces that plug in.

Nothing here imports any other part of nbos.
"""

from nbos.core.compute_backend import ComputeBackend, ProcessHandle, ProcessSpec
from nbos.core.config import Settings
from nbos.core.gpu_binder import GpuBinder
from nbos.core.host_provider import AgentCommand, HostProvider
from nbos.core.object_store import ObjectStore
from nbos.core.placement import ClusterView, HostView, PlacementPolicy, PlacementRequest
from nbos.core.replicated_log import ReplicatedLog, StateMachine
from nbos.core.transport import Transport

__all__ = [
    "AgentCommand",
    "ClusterView",
    "ComputeBackend",
    "GpuBinder",
    "HostProvider",
    "HostView",
    "ObjectStore",
    "PlacementPolicy",
    "PlacementRequest",
    "ProcessHandle",
    "ProcessSpec",
    "ReplicatedLog",
    "Settings",
    "StateMachine",
    "Transport",
]
