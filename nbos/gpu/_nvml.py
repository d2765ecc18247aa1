"""This host's GPUs as NVML reports them."""

from __future__ import annotations

import logging
from typing import Any

import pynvml

from nbos.gpu._devices import GpuDevice, Inventory

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


def nvml_inventory() -> Inventory | str:
    """The NVML view of this host, or the reason there is none."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return _reason(exc)
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        devices = tuple(
            dev for i in range(pynvml.nvmlDeviceGetCount()) if (dev := _device(i)) is not None
        )
    except pynvml.NVMLError as exc:
        return _reason(exc)
    finally:
        _shutdown()
    if not devices:
        return "NVML reports no usable GPU devices"
    log.info("NVML: %d GPUs, driver %s", len(devices), driver)
    return Inventory(devices, "nvml", driver_version=driver)


def _device(index: int) -> GpuDevice | None:
    # One broken device (fallen off the bus, no permission) must not hide the others.
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuDevice(
            index=index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            memory_total_mib=int(memory.total) // _MIB,
            memory_used_mib=int(memory.used) // _MIB,
            utilization_pct=_utilization(handle),
        )
    except pynvml.NVMLError as exc:
        log.warning("GPU %d skipped: %s", index, _reason(exc))
        return None


def _utilization(handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_NotSupported:
        return None


def _shutdown() -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.warning("nvmlShutdown failed: %s", _reason(exc))


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _text(value: str | bytes) -> str:
    # Older bindings return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value
