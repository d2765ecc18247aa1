"""A cell's GPU count: magic, then execute_request metadata, then the kernel's default."""

from __future__ import annotations

from typing import Any

import pytest

from nbos.core.errors import ConfigError, GpuError
from nbos.gateway.requests import CellGpuRequest, cell_gpus, kernel_gpus


def test_kernel_default_from_metadata() -> None:
    assert kernel_gpus({"nbos": {"gpus": 2}}) == 2
    assert kernel_gpus({"nbos": {}}, default=1) == 1
    assert kernel_gpus(None) == 0
    assert kernel_gpus({"other": 1}, default=4) == 4


@pytest.mark.parametrize(
    "bad", [{"nbos": {"gpus": -1}}, {"nbos": {"gpus": True}}, {"nbos": {"gpus": "2"}}]
)
def test_bad_kernel_default_is_a_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        kernel_gpus(bad)


def test_magic_wins_and_is_stripped() -> None:
    code = "%%gpus 3\nimport torch\nx = 1"
    meta = {"resource_request": {"gpus": 1}}
    assert cell_gpus(code, meta, 2) == CellGpuRequest(3, "magic", "import torch\nx = 1")
    assert cell_gpus("  %%gpus 0  ", None, 2) == CellGpuRequest(0, "magic", "")


def test_magic_only_on_the_first_line() -> None:
    code = "x = 1\n%%gpus 3"
    assert cell_gpus(code, None, 2) == CellGpuRequest(2, "kernel", code)
    # A line magic or a longer name is not ours.
    assert cell_gpus("%%gpusx 3\n", None, 1).source == "kernel"


def test_metadata_of_the_traces_and_of_nbos() -> None:
    trace = {"resource_request": {"gpus": 4, "cpus": 2, "memory": 1024, "vram": 8}}
    assert cell_gpus("x", trace, 1) == CellGpuRequest(4, "metadata", "x")
    both = {"nbos": {"gpus": 2}, "resource_request": {"gpus": 4}}
    assert cell_gpus("x", both, 1).gpus == 2
    assert cell_gpus("x", {"resource_request": {"cpus": 2}}, 1) == CellGpuRequest(1, "kernel", "x")


@pytest.mark.parametrize(
    ("code", "metadata"),
    [
        ("%%gpus\nx", None),
        ("%%gpus -1\nx", None),
        ("%%gpus two\nx", None),
        ("x", {"resource_request": {"gpus": -2}}),
        ("x", {"resource_request": {"gpus": 1.5}}),
        ("x", {"nbos": {"gpus": False}}),
        ("x", {"nbos": 3}),
    ],
)
def test_bad_cell_requests_are_gpu_errors(code: str, metadata: dict[str, Any] | None) -> None:
    with pytest.raises(GpuError):
        cell_gpus(code, metadata, 1)
