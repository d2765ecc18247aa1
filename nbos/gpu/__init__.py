"""GPUs of one host: inventory (NVML or virtual) and pool accounting.

In-kernel device binding and tensor residency live here too once they arrive;
they are the only parts that import torch.
"""

from nbos.gpu.inventory import GpuDevice, Inventory, discover_gpus, virtual_inventory
from nbos.gpu.pool import Allocation, GpuPool, PoolCounts, ReservationState

__all__ = [
    "Allocation",
    "GpuDevice",
    "GpuPool",
    "Inventory",
    "PoolCounts",
    "ReservationState",
    "discover_gpus",
    "virtual_inventory",
]
