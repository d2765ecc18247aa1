"""GPUs of one host: inventory (NVML or virtual) and pool accounting.

In-kernel device binding and tensor residency (``binding``) is the only part that
imports torch, and only when a namespace holds torch objects.
"""

from nbos.gpu.binding import TorchGpuBinder, device, devices
from nbos.gpu.inventory import GpuDevice, Inventory, discover_gpus, virtual_inventory
from nbos.gpu.pool import Allocation, GpuPool, PoolCounts, ReservationState

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
