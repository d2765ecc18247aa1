"""nbos: replicated, GPU-on-demand Jupyter kernels over a cluster of GPU hosts."""

from typing import TYPE_CHECKING, Any

from nbos._version import __version__
from nbos.core.errors import (
    CellLostError,
    ConfigError,
    DecodeError,
    KernelError,
    NbosError,
    PlacementError,
    UnknownKernelError,
)

if TYPE_CHECKING:
    from nbos.cluster import BlockingLocalCluster, LocalCluster, connect_blocking

# The cluster pulls in ipykernel, ZeroMQ and the Raft driver: import it on first use,
# so that `import nbos` stays cheap for the CLI and for the replica processes.
_LAZY = {"BlockingLocalCluster", "LocalCluster", "connect_blocking"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import nbos.cluster

        return getattr(nbos.cluster, name)
    raise AttributeError(f"module 'nbos' has no attribute {name!r}")


__all__ = [
    "BlockingLocalCluster",
    "CellLostError",
    "ConfigError",
    "DecodeError",
    "KernelError",
    "LocalCluster",
    "NbosError",
    "PlacementError",
    "UnknownKernelError",
    "__version__",
    "connect_blocking",
]
