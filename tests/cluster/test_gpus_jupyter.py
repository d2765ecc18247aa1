"""A kernel's GPUs per cell come from its kernelspec, through the provisioner and the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

from nbos.gpu import discover_gpus
from nbos.jupyter import kernel_json
from tests.jupyter._gateway import stop_local_gateway


def test_the_kernelspec_argv_carries_the_gpus() -> None:
    assert kernel_json(gpus=3)["argv"][-2:] == ["--gpus", "3"]
    assert kernel_json(gpus=3)["metadata"]["nbos"] == {"gpus": 3}


def test_kernelspec_metadata_sets_the_gpus_of_every_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernelspec whose argv lacks --gpus (written before the flag existed): the
    # provisioner reads {"nbos": {"gpus": 2}} from its metadata.
    if len(discover_gpus(2).devices) < 2:
        pytest.skip("this host has fewer than 2 real GPUs")
    spec = kernel_json(gpus=2)
    spec["argv"] = spec["argv"][:-2]
    kernel_dir = tmp_path / "kernels" / "nbos"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("NBOS_CLUSTER__GPUS_PER_HOST", "2")
    # A per-user gateway of its own, stopped at the end: not the user's (~/.local), which
    # it once started and left running, nor another test's, with other settings.
    runtime_dir = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime_dir))
    km = KernelManager(kernel_name="nbos")
    km.start_kernel()
    try:
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        seen: list[str] = []

        def output(msg: dict[str, object]) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream" and isinstance(content, dict):
                seen.append(str(content["text"]))

        code = "from nbos.gpu import devices\nprint(devices())"
        for cell in (code, "%%gpus 1\n" + code):
            reply = client.execute_interactive(cell, timeout=60, output_hook=output)
            assert reply["content"]["status"] == "ok"
        assert seen == ["(0, 1)\n", "(0,)\n"]
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
        stop_local_gateway(runtime_dir)
