"""What GPUs a host has: real ones through NVML, or virtual ones where no driver exists.

Virtual GPUs let every test and the demo run on a CPU-only machine: the control
plane accounts for them exactly as for real devices. That NVML is missing (no
driver, no library, no permission) is a fact about the host, reported in
:attr:`Inventory.nvml_unavailable_reason`, never an error in ``"auto"`` mode.
"""

from __future__ import annotations

import logging
from typing import Literal

from nbos.core.errors import ConfigError, GpuError
from nbos.gpu._devices import GpuDevice, Inventory

log = logging.getLogger(__name__)

DiscoveryMode = Literal["auto", "nvml", "virtual"]

#: Virtual GPUs per host when none is configured; matches ``[cluster] gpus_per_host``.
DEFAULT_VIRTUAL_COUNT = 8
#: Memory of one virtual GPU; matches ``[cluster] gpu_memory_mib``.
DEFAULT_VIRTUAL_MEMORY_MIB = 40_960


def discover_gpus(
    virtual_count: int | None = None,
    virtual_memory_mib: int = DEFAULT_VIRTUAL_MEMORY_MIB,
    *,
    mode: DiscoveryMode = "auto",
) -> Inventory:
    """Find this host's GPUs.

    ``mode="auto"`` uses NVML when it loads and reports at least one device, else
    ``virtual_count`` virtual GPUs (default :data:`DEFAULT_VIRTUAL_COUNT`) of
    ``virtual_memory_mib`` each. ``"virtual"`` skips NVML; ``"nvml"`` requires it
    and raises :class:`GpuError` (with the reason) when it is unavailable.
    """
    count = DEFAULT_VIRTUAL_COUNT if virtual_count is None else virtual_count
    if count < 0:
        raise ConfigError("virtual_count", virtual_count, "a non-negative number of GPUs")
    if virtual_memory_mib <= 0:
        raise ConfigError("virtual_memory_mib", virtual_memory_mib, "a positive size in MiB")
    if mode == "virtual":
        return virtual_inventory(count, virtual_memory_mib, reason="virtual GPUs requested")
    # Imported here: pynvml costs every process that only accounts for GPUs (a replica
    # binding them, a simulator) about 2 MiB.
    from nbos.gpu._nvml import nvml_inventory

    found = nvml_inventory()
    if isinstance(found, Inventory):
        return found
    if mode == "nvml":
        raise GpuError(f"NVML is unavailable: {found}")
    log.info("NVML unavailable (%s); using %d virtual GPUs", found, count)
    return virtual_inventory(count, virtual_memory_mib, reason=found)


def virtual_inventory(count: int, memory_mib: int, *, reason: str) -> Inventory:
    """``count`` idle virtual GPUs of ``memory_mib`` each."""
    devices = tuple(
        GpuDevice(
            index=i,
            uuid=f"GPU-virtual-{i:04d}",
            name="nbos virtual GPU",
            memory_total_mib=memory_mib,
            memory_used_mib=0,
            utilization_pct=0,
        )
        for i in range(count)
    )
    return Inventory(devices, "virtual", nvml_unavailable_reason=reason)
