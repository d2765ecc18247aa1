"""The front-replica protocol module: what each side builds, the other reads; and the
front loads neither the replica's ipykernel nor Raft."""

from __future__ import annotations

import json
import subprocess
import sys

from nbos.kernel import protocol


def _modules_after_import(module: str) -> set[str]:
    """The modules a fresh interpreter holds once it imported ``module``."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return set(json.loads(out))


def _under(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in packages or m.startswith(packages))


def test_the_front_loads_neither_ipykernel_nor_ipython_nor_raft() -> None:
    loaded = _modules_after_import("nbos.kernel.front")
    heavy = ("ipykernel", "IPython", "nbos.raft", "nbos.kernel.replica")
    assert _under(loaded, *heavy) == []
    assert "nbos.kernel.protocol" in loaded


def test_the_replica_uses_the_protocol_without_loading_the_front() -> None:
    loaded = _modules_after_import("nbos.kernel.replica")
    assert "nbos.kernel.protocol" in loaded
    assert _under(loaded, "nbos.kernel.front") == []
    # Every replica of every kernel pays for what it imports (about 2 MiB for pynvml); a
    # replica binds the GPUs the agent found, it never asks NVML itself.
    assert _under(loaded, "pynvml") == []
    # Nor the agents' GPU pool, the in-memory network, placement or the settings-file
    # parser: the packages that export them load them on first use.
    for unused in ("nbos.gpu.pool", "nbos.transport.memory", "nbos.core.placement", "tomllib"):
        assert _under(loaded, unused) == [], unused


def test_a_cell_request_reads_back_what_the_front_put_in_it() -> None:
    client = {"cellId": "c1"}
    metadata = protocol.cell_metadata(client, 7, (0, 3))
    assert metadata["cellId"] == "c1" and client == {"cellId": "c1"}
    assert protocol.cell_request(metadata) == (7, (0, 3))


def test_only_a_reply_naming_a_winner_says_the_claim_lost() -> None:
    lost = {protocol.REPLY_INFO_KEY: protocol.claim_lost_info(2)}
    ran = {protocol.REPLY_INFO_KEY: {"exec_index": 3, "replica": 1}}
    assert protocol.claim_lost(lost)
    assert not protocol.claim_lost(ran)
    assert not protocol.claim_lost({})
    assert not protocol.claim_lost({protocol.REPLY_INFO_KEY: "claim_lost_to"})


def test_a_replys_iopub_count_is_taken_out_of_its_metadata() -> None:
    metadata = {protocol.IOPUB_COUNT_KEY: 3, "nbos": {}}
    assert protocol.take_published_count(metadata) == 3
    assert metadata == {"nbos": {}}
    assert protocol.take_published_count(metadata) is None
    for bad in ("3", -1, True, 2.0, None):
        assert protocol.take_published_count({protocol.IOPUB_COUNT_KEY: bad}) is None


def test_control_requests_have_replies_of_the_jupyter_form() -> None:
    assert protocol.reply_of(protocol.LOST_REQUEST) == "nbos_lost_reply"
    assert protocol.reply_of(protocol.MEMBER_REQUEST) == "nbos_member_reply"


def test_error_content_names_the_exception_class() -> None:
    content = protocol.error_content(ValueError("bad"), 4)
    assert content == {
        "status": "error",
        "ename": "ValueError",
        "evalue": "bad",
        "traceback": ["ValueError: bad"],
        "execution_count": 4,
    }


def test_an_interrupt_names_its_cell_and_anything_else_names_none() -> None:
    metadata = protocol.interrupt_metadata({"user": 1}, "cell-1")
    assert metadata["user"] == 1
    assert protocol.interrupted_cell(metadata) == "cell-1"
    for other in ({}, None, [], {protocol.INTERRUPTED_CELL_KEY: 7}):
        assert protocol.interrupted_cell(other) is None
