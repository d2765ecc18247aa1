"""A host's GPU devices and where the list came from (NVML or virtual)."""

from __future__ import annotations

from typing import Literal

import attrs

InventorySource = Literal["nvml", "virtual"]


@attrs.frozen
class GpuDevice:
    """One device. ``utilization_pct`` is ``None`` where the device cannot report it."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: int | None


@attrs.frozen
class Inventory:
    """The GPUs found on this host and where the answer came from."""

    devices: tuple[GpuDevice, ...]
    source: InventorySource
    #: Why NVML was not used (``None`` when it was).
    nvml_unavailable_reason: str | None = None
    driver_version: str | None = None

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self.devices)
