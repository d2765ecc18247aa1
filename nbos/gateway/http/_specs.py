"""The kernelspecs the API offers: ``nbos`` and ``nbos-gpu-N``, GPUs per cell in metadata.

A kernelspec here names no command (the gateway starts the kernel's replicas
itself); Jupyter Server shows ``display_name`` and ``language`` and passes the
name back on ``POST /api/kernels``. ``nbos-gpu-N`` exists for the powers of two
up to the largest host's GPU count, and for that count itself: no cell of a kernel
can ask one host for more GPUs than it has.
"""

from __future__ import annotations

from typing import Any

DEFAULT_SPEC = "nbos"
_GPU_PREFIX = "nbos-gpu-"


def spec_names(max_gpus: int) -> list[str]:
    """Every kernelspec name for a cluster whose largest host has ``max_gpus`` GPUs."""
    counts = {1 << i for i in range(max_gpus.bit_length()) if 1 << i <= max_gpus}
    if max_gpus > 0:
        counts.add(max_gpus)
    return [DEFAULT_SPEC, *(f"{_GPU_PREFIX}{n}" for n in sorted(counts))]


def spec_gpus(name: str, max_gpus: int) -> int | None:
    """The GPUs per cell of kernelspec ``name``; ``None`` if there is no such spec."""
    if name not in spec_names(max_gpus):
        return None
    return int(name.removeprefix(_GPU_PREFIX)) if name != DEFAULT_SPEC else 0


def spec_name(gpus: int) -> str:
    """The kernelspec of ``gpus`` GPUs per cell."""
    return f"{_GPU_PREFIX}{gpus}" if gpus else DEFAULT_SPEC


def spec_model(name: str, gpus: int) -> dict[str, Any]:
    """``GET /api/kernelspecs/NAME``'s answer, as Jupyter Server gives it."""
    title = "nbos (replicated Python)" if gpus == 0 else f"nbos, {gpus} GPU(s) per cell"
    return {
        "name": name,
        "spec": {
            "argv": [],
            "env": {},
            "display_name": title,
            "language": "python",
            "interrupt_mode": "message",
            "metadata": {"debugger": False, "nbos": {"gpus": gpus}},
        },
        "resources": {},
    }


def specs_model(max_gpus: int) -> dict[str, Any]:
    """``GET /api/kernelspecs``'s answer."""
    specs = {
        name: spec_model(name, spec_gpus(name, max_gpus) or 0) for name in spec_names(max_gpus)
    }
    return {"default": DEFAULT_SPEC, "kernelspecs": specs}
