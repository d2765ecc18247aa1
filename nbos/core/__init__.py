"""The bottom layer: ids, errors, config, the wire format and the interfaces that plug in.

Nothing here imports any other part of nbos. The interfaces are imported on first use.
"""

from typing import TYPE_CHECKING

from nbos.core.lazy import lazy_exports

if TYPE_CHECKING:
    from nbos.core.compute_backend import ComputeBackend, ProcessHandle, ProcessSpec
    from nbos.core.config import Settings
    from nbos.core.executor_chooser import CellPlan, ChoiceRequest, ExecutorChooser
    from nbos.core.host_provider import AgentCommand, HostProvider
    from nbos.core.log_storage import LogStorage
    from nbos.core.object_store import ObjectStore, StoreFactory
    from nbos.core.placement import ClusterView, HostView, PlacementPolicy, PlacementRequest
    from nbos.core.replica_launcher import AdoptingLauncher, ReplicaLauncher
    from nbos.core.replicated_log import ReplicatedLog, StateMachine
    from nbos.core.transport import Transport

__getattr__ = lazy_exports(
    __name__,
    {
        "nbos.core.compute_backend": ("ComputeBackend", "ProcessHandle", "ProcessSpec"),
        "nbos.core.config": ("Settings",),
        "nbos.core.executor_chooser": ("CellPlan", "ChoiceRequest", "ExecutorChooser"),
        "nbos.core.host_provider": ("AgentCommand", "HostProvider"),
        "nbos.core.log_storage": ("LogStorage",),
        "nbos.core.object_store": ("ObjectStore", "StoreFactory"),
        "nbos.core.placement": ("ClusterView", "HostView", "PlacementPolicy", "PlacementRequest"),
        "nbos.core.replica_launcher": ("AdoptingLauncher", "ReplicaLauncher"),
        "nbos.core.replicated_log": ("ReplicatedLog", "StateMachine"),
        "nbos.core.transport": ("Transport",),
    },
)

__all__ = [
    "AdoptingLauncher",
    "AgentCommand",
    "CellPlan",
    "ChoiceRequest",
    "ClusterView",
    "ComputeBackend",
    "ExecutorChooser",
    "HostProvider",
    "HostView",
    "LogStorage",
    "ObjectStore",
    "PlacementPolicy",
    "PlacementRequest",
    "ProcessHandle",
    "ProcessSpec",
    "ReplicaLauncher",
    "ReplicatedLog",
    "Settings",
    "StateMachine",
    "StoreFactory",
    "Transport",
]
