"""GPU inventory: virtual GPUs, the reason NVML is missing, and the NVML path itself.

The NVML path runs against ``fake_nvml.c``, built here into a ``libnvidia-ml.so.1``
that a child process loads through ``LD_LIBRARY_PATH``: pynvml, ctypes and dlopen
are the real ones, only the driver behind the C ABI is a stand-in.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from nbos.core.errors import ConfigError, GpuError
from nbos.gpu import discover_gpus

HERE = Path(__file__).parent

PROBE = """
import json, sys, attrs
from nbos.gpu import discover_gpus
try:
    inv = discover_gpus(virtual_count=2, mode=sys.argv[1])
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps(attrs.asdict(inv)))
"""


def _nvml_loads() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    out = tmp_path_factory.mktemp("fake-nvml")
    lib = out / "libnvidia-ml.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", lib, HERE / "fake_nvml.c"], check=True)
    return out


def _probe(lib_dir: Path, log: Path, mode: str = "auto", **env: str) -> dict[str, object]:
    child_env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(lib_dir),
        "FAKE_NVML_LOG": str(log),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env=child_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_virtual_mode_gives_configured_gpus() -> None:
    inv = discover_gpus(virtual_count=3, virtual_memory_mib=1024, mode="virtual")
    assert inv.source == "virtual"
    assert inv.indices == (0, 1, 2)
    assert {d.memory_total_mib for d in inv.devices} == {1024}
    assert len({d.uuid for d in inv.devices}) == 3
    assert inv.nvml_unavailable_reason == "virtual GPUs requested"


@pytest.mark.skipif(_nvml_loads(), reason="this host has a working NVML")
def test_missing_nvml_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nbos.gpu.inventory"):
        inv = discover_gpus(virtual_count=4)
    assert inv.source == "virtual"
    assert len(inv.devices) == 4
    assert inv.nvml_unavailable_reason is not None
    assert inv.nvml_unavailable_reason.startswith("NVMLError_LibraryNotFound")
    assert any(
        r.levelno == logging.INFO and "NVML unavailable" in r.getMessage() for r in caplog.records
    )


@pytest.mark.skipif(_nvml_loads(), reason="this host has a working NVML")
def test_nvml_mode_without_nvml_raises_with_reason() -> None:
    with pytest.raises(GpuError, match="NVMLError_LibraryNotFound"):
        discover_gpus(mode="nvml")


def test_nvml_path_reads_devices_and_shuts_down(fake_nvml_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls"
    inv = _probe(fake_nvml_dir, log)
    assert inv["source"] == "nvml"
    assert inv["nvml_unavailable_reason"] is None
    assert inv["driver_version"] == "999.99.01"
    # Device 2 is lost: skipped, the others are still reported.
    assert inv["devices"] == [
        {
            "index": 0,
            "uuid": "GPU-fake-0000",
            "name": "Fake H100 #0",
            "memory_total_mib": 81559,
            "memory_used_mib": 512,
            "utilization_pct": 42,
        },
        {
            "index": 1,
            "uuid": "GPU-fake-0001",
            "name": "Fake H100 #1",
            "memory_total_mib": 81559,
            "memory_used_mib": 1024,
            "utilization_pct": None,
        },
    ]
    assert log.read_text().split() == ["init", "shutdown"]


def test_driver_not_loaded_falls_back_to_virtual(fake_nvml_dir: Path, tmp_path: Path) -> None:
    inv = _probe(fake_nvml_dir, tmp_path / "calls", FAKE_NVML_INIT_RC="9")
    assert inv["source"] == "virtual"
    assert len(inv["devices"]) == 2  # type: ignore[arg-type]
    assert str(inv["nvml_unavailable_reason"]).startswith("NVMLError_DriverNotLoaded")


def test_nvml_with_no_devices_falls_back_in_auto_and_raises_in_nvml_mode(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    auto = _probe(fake_nvml_dir, log, FAKE_NVML_COUNT="0")
    assert auto["source"] == "virtual"
    assert auto["nvml_unavailable_reason"] == "NVML reports no usable GPU devices"
    strict = _probe(fake_nvml_dir, log, "nvml", FAKE_NVML_COUNT="0")
    assert strict["error"] == "GpuError"
    assert log.read_text().split() == ["init", "shutdown", "init", "shutdown"]


@pytest.mark.parametrize(("count", "memory"), [(-1, 1024), (2, 0)])
def test_bad_virtual_settings_are_config_errors(count: int, memory: int) -> None:
    with pytest.raises(ConfigError):
        discover_gpus(virtual_count=count, virtual_memory_mib=memory, mode="virtual")
