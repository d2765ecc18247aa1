"""The gateway's state file: what an older gateway wrote still loads."""

from __future__ import annotations

from pathlib import Path

import msgspec

from nbos.gateway._state import FrontRecord, GatewayState, KernelRecord, ReplicaRecord, StateFile

FRONT = FrontRecord(
    ip="127.0.0.1",
    shell_port=1,
    iopub_port=2,
    stdin_port=3,
    control_port=4,
    hb_port=5,
    key="k",
    session="s",
)


def replica(**extra: object) -> dict[str, object]:
    return {
        "node": 1,
        "host": "h1",
        "process": "p1",
        "workdir": "/w",
        "key": "k",
        "argv": ["python"],
        "raft": "tcp://127.0.0.1:7001",
        "connection": {"ip": "127.0.0.1"},
        **extra,
    }


def test_a_replica_record_with_the_old_forwarder_address_loads(tmp_path: Path) -> None:
    # Replicas had a proposal forwarder beside their Raft transport until forwarding
    # moved into the Raft driver; a gateway of then recorded its address.
    old = {"version": 1, "kernels": [{"kernel_id": "k1", "gpus": 0, "front": FRONT}]}
    old["kernels"][0]["replicas"] = [replica(forward="tcp://127.0.0.1:7002")]  # type: ignore[index]
    path = tmp_path / "state.json"
    path.write_bytes(msgspec.json.encode(old))
    [kernel] = StateFile(path).load().kernels
    assert kernel.replicas[0].raft == "tcp://127.0.0.1:7001"


def test_a_new_record_names_no_forwarder(tmp_path: Path) -> None:
    record = msgspec.convert(replica(), ReplicaRecord)
    state = GatewayState(
        kernels=[KernelRecord(kernel_id="k1", gpus=0, front=FRONT, replicas=[record])]
    )
    path = tmp_path / "state.json"
    StateFile(path).save(state)
    assert b"forward" not in path.read_bytes()
    assert StateFile(path).load() == state
