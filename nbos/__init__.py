"""nbos: replicated, GPU-on-demand Jupyter kernels over a cluster of GPU hosts."""

from typing import TYPE_CHECKING

from nbos._version import __version__
from nbos.core.errors import (
    CellLostError,
    ConfigError,
    DecodeError,
    KernelError,
    NbosError,
    OverloadedError,
    PlacementError,
    UnknownKernelError,
)
from nbos.core.lazy import lazy_exports

if TYPE_CHECKING:
    from nbos.cluster import BlockingLocalCluster, LocalCluster, connect_blocking

# The cluster pulls in ipykernel, ZeroMQ and the Raft driver: import it on first use,
# so that `import nbos` stays cheap for the CLI and for the replica processes.
__getattr__ = lazy_exports(
    __name__, {"nbos.cluster": ("BlockingLocalCluster", "LocalCluster", "connect_blocking")}
)


__all__ = [
    "BlockingLocalCluster",
    "CellLostError",
    "ConfigError",
    "DecodeError",
    "KernelError",
    "LocalCluster",
    "NbosError",
    "OverloadedError",
    "PlacementError",
    "UnknownKernelError",
    "__version__",
    "connect_blocking",
]
