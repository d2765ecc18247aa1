"""The gateway's state file: what an older gateway wrote still loads; a write that the
disk refuses raises :class:`StateWriteError` and leaves the file as it was."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.core.errors import StateWriteError
from nbos.gateway._state import (
    STATE_VERSION,
    FrontRecord,
    GatewayState,
    KernelRecord,
    ReplicaRecord,
    StartRecord,
    StateFile,
    StateWriter,
)
from tests.gateway._full_disk import fill, small_tmpfs

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


def test_a_version_1_file_loads_with_a_state_id_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b'{"version": 1, "kernels": []}')
    file = StateFile(path)
    state = file.load()
    assert state.version == STATE_VERSION
    assert state.state_id and file.state_id == state.state_id
    assert state.starting == []


def test_the_state_id_is_kept_by_the_file_and_new_without_one(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = StateFile(path).load()  # no file yet: a new state
    StateFile(path).save(first)
    assert StateFile(path).load().state_id == first.state_id
    path.unlink()
    assert StateFile(path).load().state_id != first.state_id


def test_the_file_says_its_generation(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    StateFile(path).save(GatewayState(generation=7))
    file = StateFile(path)
    assert file.generation == 0
    assert file.load().generation == file.generation == 7


def test_a_write_to_a_full_disk_fails_typed_and_keeps_the_old_file(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        path = disk / "state.json"
        file = StateFile(path)
        old = GatewayState(state_id=file.state_id)
        file.save(old)
        fill(disk)
        big = msgspec.structs.replace(
            old, starting=[StartRecord(kernel_id=f"k{i}", hosts=["h"] * 50) for i in range(200)]
        )
        with pytest.raises(StateWriteError) as failed:
            file.save(big)
        assert failed.value.errno == errno.ENOSPC
        assert "ENOSPC" in str(failed.value) and str(path) in str(failed.value)
        assert file.load() == old
        # No half-written copy keeps the space the next write needs.
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "state.json"]


def _starting(ids: list[str]) -> Callable[[int], GatewayState]:
    """A snapshot of the starts in ``ids`` as they are when it is taken."""

    def snapshot(generation: int) -> GatewayState:
        starts = [StartRecord(kernel_id=k, hosts=["h"] * 50) for k in ids]
        return GatewayState(generation=generation, starting=starts)

    return snapshot


@pytest.mark.anyio
async def test_changes_asked_to_be_written_at_once_share_a_write_each_caller_finding_its_own(
    tmp_path: Path,
) -> None:
    file = StateFile(tmp_path / "state.json")
    writer = StateWriter(file)
    ids: list[str] = []
    found: dict[str, bool] = {}

    async def start(kernel_id: str) -> None:
        ids.append(kernel_id)  # the change, in memory first (as a start records itself)
        await writer.write(_starting(ids))
        on_disk = StateFile(file.path).load()
        found[kernel_id] = kernel_id in {s.kernel_id for s in on_disk.starting}

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(start, f"k{i}")
    assert found == {f"k{i}": True for i in range(10)}
    # One or two writes (the first may run alone, the others asked while it ran share
    # the next), where each change had a write of its own, one after another, before.
    assert file.load().generation == writer.written
    assert writer.written in (1, 2)


@pytest.mark.anyio
async def test_every_caller_of_a_failed_group_write_hears_of_its_failure(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        file = StateFile(disk / "state.json")
        writer = StateWriter(file)
        await writer.write(_starting([]))
        filler = fill(disk)
        ids = [f"k{i}" for i in range(200)]  # too big for what is left
        failed: list[str] = []

        async def start(kernel_id: str) -> None:
            try:
                await writer.write(_starting(ids))
            except StateWriteError:
                failed.append(kernel_id)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(start, f"k{i}")
        assert sorted(failed) == [f"k{i}" for i in range(5)]
        assert file.load().starting == [] and writer.written == 1
        filler.unlink()
        await writer.write(_starting(ids))
        assert len(file.load().starting) == 200
