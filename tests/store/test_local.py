"""LocalObjectStore specifics: layout, part files shared between processes, bad roots."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from nbos.core.errors import StoreError
from nbos.store import LocalObjectStore

pytestmark = pytest.mark.anyio


async def test_blobs_live_in_fan_out_directories(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = await store.put(b"fan out")
    digest = hashlib.sha256(b"fan out").hexdigest()
    assert store.path_of(key) == tmp_path / digest[:2] / digest[2:]
    assert store.path_of(key).read_bytes() == b"fan out"


async def test_opening_the_store_spares_the_part_file_of_a_live_writer(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    halfway = anyio.Event()
    resume = anyio.Event()
    keys = []

    async def two_halves() -> AsyncIterator[bytes]:
        yield b"a" * 1000
        halfway.set()
        await resume.wait()
        yield b"b" * 1000

    async def put() -> None:
        keys.append(await store.put_stream(two_halves()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        await halfway.wait()
        (part,) = (tmp_path / "tmp").iterdir()
        # What another process does when it opens the same store.
        await anyio.to_thread.run_sync(LocalObjectStore, tmp_path)
        assert part.exists()
        resume.set()

    assert await store.get(keys[0]) == b"a" * 1000 + b"b" * 1000
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_opening_the_store_removes_abandoned_part_files_only(tmp_path: Path) -> None:
    LocalObjectStore(tmp_path)
    abandoned = tmp_path / "tmp" / "0123.part"
    abandoned.write_bytes(b"half a blob")
    unrelated = tmp_path / "tmp" / "notes.txt"
    unrelated.write_bytes(b"not ours to remove")
    LocalObjectStore(tmp_path)
    assert not abandoned.exists()
    assert unrelated.exists()


async def test_put_repairs_a_truncated_blob(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    data = b"x" * 10_000
    key = await store.put(data)
    store.path_of(key).write_bytes(data[:10])
    assert await store.put(data) == key
    assert await store.get(key) == data


def test_a_root_that_cannot_be_created_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreError, match="cannot open object store"):
        LocalObjectStore(blocker / "store")


async def test_write_failures_become_store_errors(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    (tmp_path / "tmp").rmdir()
    with pytest.raises(StoreError, match="cannot write a blob"):
        await store.put(b"nowhere to go")
