"""GPUs of one host: inventory (NVML or virtual) and pool accounting.

In-kernel device binding and tensor residency (``binding``) is the only part that
imports torch, and only when a namespace holds torch objects.
"""

from typing import TYPE_CHECKING

from nbos.core.lazy import lazy_exports
from nbos.gpu.binding import TorchGpuBinder, device, devices

if TYPE_CHECKING:
    from nbos.gpu._devices import GpuDevice, Inventory
    from nbos.gpu.inventory import discover_gpus, virtual_inventory
    from nbos.gpu.pool import Allocation, GpuPool, PoolCounts, ReservationState

# A replica needs only ``binding``; the agents' inventory and pool load on first use.
__getattr__ = lazy_exports(
    __name__,
    {
        "nbos.gpu._devices": ("GpuDevice", "Inventory"),
        "nbos.gpu.inventory": ("discover_gpus", "virtual_inventory"),
        "nbos.gpu.pool": ("Allocation", "GpuPool", "PoolCounts", "ReservationState"),
    },
)

__all__ = [
    "Allocation",
    "GpuDevice",
    "GpuPool",
    "Inventory",
    "PoolCounts",
    "ReservationState",
    "TorchGpuBinder",
    "device",
    "devices",
    "discover_gpus",
    "virtual_inventory",
]
