"""How many GPUs a cell asks for.

Three sources, the first one present wins:

1. a first-line cell magic ``%%gpus N``: the front strips that line before the
   code goes to the replicas, so every replica runs (and logs) the same code and
   no IPython magic has to be registered in the replica;
2. the ``execute_request`` metadata: ``metadata["nbos"]["gpus"]``, else
   ``metadata["resource_request"]["gpus"]``, the key the NotebookOS prototype's
   workload driver sends with each cell of the paper's traces (its resource
   request also carries ``cpus``, ``memory`` and ``vram``, which nbos ignores);
3. the kernel's default, from its kernelspec or provisioner config:
   ``{"nbos": {"gpus": N}}`` in the kernel's metadata (:func:`kernel_gpus`).

A count is a non-negative ``int`` (a bool is not a count). A bad value is a
:class:`~nbos.core.errors.GpuError` (for a cell) or
:class:`~nbos.core.errors.ConfigError` (for a kernel), never silently ignored.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from nbos.core.errors import ConfigError, GpuError

log = logging.getLogger(__name__)

GpuSource = Literal["magic", "metadata", "kernel"]

_MAGIC = re.compile(r"^[ \t]*%%gpus(?:[ \t]+(?P<n>\S+))?[ \t]*$")


@attrs.frozen
class CellGpuRequest:
    """A cell's GPU count, where it came from, and the code to run (magic line removed)."""

    gpus: int
    source: GpuSource
    code: str


def kernel_gpus(kernel_metadata: Mapping[str, Any] | None, default: int = 0) -> int:
    """The kernel's GPUs per cell from ``{"nbos": {"gpus": N}}``, else ``default``."""
    section = (kernel_metadata or {}).get("nbos")
    if section is None or "gpus" not in section:
        return default
    if not isinstance(section, Mapping) or not _is_count(section["gpus"]):
        value = section.get("gpus") if isinstance(section, Mapping) else section
        log.warning("kernel metadata nbos.gpus = %r refused", value)
        raise ConfigError("nbos.gpus", value, "a non-negative integer number of GPUs")
    return int(section["gpus"])


def cell_gpus(code: str, metadata: Mapping[str, Any] | None, kernel_default: int) -> CellGpuRequest:
    """The GPU count of one cell (see the module docstring for the order)."""
    first, newline, rest = code.partition("\n")
    match = _MAGIC.match(first)
    if match is not None:
        return CellGpuRequest(_count(match.group("n"), "%%gpus"), "magic", rest if newline else "")
    found = _from_metadata(metadata or {})
    if found is not None:
        return CellGpuRequest(found, "metadata", code)
    return CellGpuRequest(kernel_default, "kernel", code)


def _from_metadata(metadata: Mapping[str, Any]) -> int | None:
    for key in ("nbos", "resource_request"):
        section = metadata.get(key)
        if isinstance(section, Mapping) and "gpus" in section:
            return _count(section["gpus"], f"metadata {key}.gpus")
        if section is not None and not isinstance(section, Mapping):
            log.warning("execute_request metadata %s = %r is not a mapping", key, section)
            raise GpuError(f"execute_request metadata {key!r} must be a mapping, got {section!r}")
    return None


def _count(value: object, where: str) -> int:
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    if isinstance(value, int) and _is_count(value):
        return value
    log.warning("%s = %r refused", where, value)
    raise GpuError(f"{where}: {value!r} is not a non-negative whole number of GPUs")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
