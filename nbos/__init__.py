"""nbos: replicated, GPU-on-demand Jupyter kernels over a cluster of GPU hosts."""

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

__all__ = [
    "CellLostError",
    "ConfigError",
    "DecodeError",
    "KernelError",
    "NbosError",
    "PlacementError",
    "UnknownKernelError",
    "__version__",
]
