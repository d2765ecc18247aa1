"""The ObjectStore contract, checked against every implementation (see conftest.harness)."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from collections.abc import AsyncIterator

import anyio
import pytest

from nbos.core.errors import (
    BlobCorruptError,
    BlobNotFoundError,
    InvalidBlobKeyError,
    StoreError,
)
from nbos.core.ids import BlobKey
from nbos.core.object_store import ObjectStore
from tests.store._harness import REDIS_CHUNK_BYTES, Harness

pytestmark = pytest.mark.anyio

MIB = 1 << 20
#: Size of the bounded-memory stream; override with NBOS_TEST_STREAM_MIB for a soak.
STREAM_MIB = int(os.environ.get("NBOS_TEST_STREAM_MIB", "64"))


def key_for(data: bytes) -> BlobKey:
    return BlobKey("sha256:" + hashlib.sha256(data).hexdigest())


def pattern(size: int, seed: int = 0) -> bytes:
    """``size`` deterministic bytes that differ from chunk to chunk."""
    block = hashlib.sha256(seed.to_bytes(8, "big")).digest()
    return (block * (size // len(block) + 1))[:size]


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in stream]


def test_both_implementations_satisfy_the_protocol() -> None:
    from nbos.store import LocalObjectStore, RedisObjectStore

    assert issubclass(LocalObjectStore, ObjectStore)
    assert issubclass(RedisObjectStore, ObjectStore)


@pytest.mark.parametrize("size", [0, 1, 1000, REDIS_CHUNK_BYTES, 3 * REDIS_CHUNK_BYTES + 7])
async def test_put_then_get_round_trips(harness: Harness, size: int) -> None:
    data = os.urandom(size)
    key = await harness.store.put(data)
    assert key == key_for(data)
    assert await harness.store.contains(key)
    assert await harness.store.get(key) == data
    assert b"".join(await collect(harness.store.get_stream(key))) == data


async def test_put_is_idempotent_and_agrees_with_put_stream(harness: Harness) -> None:
    data = pattern(REDIS_CHUNK_BYTES + 123)

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 1000):
            yield data[start : start + 1000]

    first = await harness.store.put(data)
    again = await harness.store.put(data)
    streamed = await harness.store.put_stream(pieces())
    assert first == again == streamed == key_for(data)
    assert await harness.store.get(first) == data
    # Stored once: a single delete removes it.
    await harness.store.delete(first)
    assert not await harness.store.contains(first)
    assert await harness.leftovers() == []


async def test_concurrent_puts_of_the_same_content_store_one_blob(harness: Harness) -> None:
    data = pattern(2 * REDIS_CHUNK_BYTES + 5, seed=7)

    async def one_chunk() -> AsyncIterator[bytes]:
        yield data

    keys: list[BlobKey] = []

    async def put() -> None:
        keys.append(await harness.store.put_stream(one_chunk()))

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(put)
    assert keys == [key_for(data)] * 6
    assert await harness.store.get(keys[0]) == data
    assert await harness.leftovers() == []


async def test_a_large_stream_passes_through_in_bounded_memory(harness: Harness) -> None:
    size = STREAM_MIB * MIB
    hasher = hashlib.sha256()

    async def source() -> AsyncIterator[bytes]:
        for i in range(STREAM_MIB):
            chunk = pattern(MIB, seed=i)
            hasher.update(chunk)
            yield chunk

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        key = await harness.store.put_stream(source())
        put_peak = tracemalloc.get_traced_memory()[1]

        tracemalloc.reset_peak()
        read = hashlib.sha256()
        sizes = set()
        total = 0
        async for chunk in harness.store.get_stream(key, chunk_size=MIB):
            read.update(chunk)
            sizes.add(len(chunk))
            total += len(chunk)
        get_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert key == "sha256:" + hasher.hexdigest()
    assert read.hexdigest() == hasher.hexdigest()
    assert total == size
    assert sizes == {MIB}
    # A handful of chunks in flight, never the blob: the blob is 64 MiB by default.
    assert put_peak < 8 * MIB, f"put_stream peaked at {put_peak / MIB:.1f} MiB"
    assert get_peak < 8 * MIB, f"get_stream peaked at {get_peak / MIB:.1f} MiB"


@pytest.mark.parametrize("chunk_size", [1, 4096, 100_003, REDIS_CHUNK_BYTES, 10 * MIB])
async def test_get_stream_yields_chunks_of_the_requested_size(
    harness: Harness, chunk_size: int
) -> None:
    data = pattern(2 * REDIS_CHUNK_BYTES + 999 if chunk_size > 1 else 5000, seed=3)
    key = await harness.store.put(data)
    chunks = await collect(harness.store.get_stream(key, chunk_size=chunk_size))
    assert b"".join(chunks) == data
    assert all(len(chunk) == chunk_size for chunk in chunks[:-1])
    assert 0 < len(chunks[-1]) <= chunk_size


async def test_get_stream_of_an_empty_blob_yields_nothing(harness: Harness) -> None:
    key = await harness.store.put(b"")
    assert await collect(harness.store.get_stream(key)) == []
    assert await harness.store.get(key) == b""


@pytest.mark.parametrize("chunk_size", [0, -1])
async def test_get_stream_refuses_a_useless_chunk_size(harness: Harness, chunk_size: int) -> None:
    key = await harness.store.put(b"x")
    with pytest.raises(StoreError, match="chunk_size"):
        await collect(harness.store.get_stream(key, chunk_size=chunk_size))


async def test_a_missing_key_is_not_found(harness: Harness) -> None:
    key = key_for(b"never stored")
    assert not await harness.store.contains(key)
    with pytest.raises(BlobNotFoundError) as info:
        await harness.store.get(key)
    assert info.value.key == key
    with pytest.raises(BlobNotFoundError):
        await collect(harness.store.get_stream(key))


async def test_delete_removes_the_blob_and_tolerates_a_missing_one(harness: Harness) -> None:
    keep = await harness.store.put(b"keep")
    gone = await harness.store.put(b"gone")
    await harness.store.delete(gone)
    await harness.store.delete(gone)
    assert not await harness.store.contains(gone)
    with pytest.raises(BlobNotFoundError):
        await harness.store.get(gone)
    assert await harness.store.get(keep) == b"keep"


@pytest.mark.parametrize("size", [10, 3 * REDIS_CHUNK_BYTES])
async def test_a_corrupt_blob_is_detected(harness: Harness, size: int) -> None:
    data = pattern(size, seed=size)
    key = await harness.store.put(data)
    await harness.corrupt(key)
    with pytest.raises(BlobCorruptError) as info:
        await harness.store.get(key)
    assert info.value.key == key
    with pytest.raises(BlobCorruptError):
        await collect(harness.store.get_stream(key, chunk_size=4096))


async def test_cancelling_put_stream_leaves_no_blob_and_no_part(harness: Harness) -> None:
    written = anyio.Event()
    sent = pattern(3 * REDIS_CHUNK_BYTES, seed=11)

    async def stalls_after_three_chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(sent), REDIS_CHUNK_BYTES):
            yield sent[start : start + REDIS_CHUNK_BYTES]
        written.set()
        await anyio.sleep_forever()
        yield b"never"

    async with anyio.create_task_group() as tg:
        tg.start_soon(harness.store.put_stream, stalls_after_three_chunks())
        await written.wait()
        assert await harness.leftovers() != []  # the write really was under way
        tg.cancel_scope.cancel()

    assert not await harness.store.contains(key_for(sent))
    assert await harness.leftovers() == []
    assert await harness.store.get(await harness.store.put(sent)) == sent


async def test_a_failing_source_fails_put_stream_and_leaves_nothing(harness: Harness) -> None:
    async def breaks() -> AsyncIterator[bytes]:
        yield pattern(REDIS_CHUNK_BYTES + 1)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        await harness.store.put_stream(breaks())
    assert await harness.leftovers() == []


BAD_KEYS = [
    "",
    "sha256:",
    "sha256:../../../../etc/passwd",
    "sha256:" + "0" * 62 + "/.",
    "sha256:" + "A" * 64,
    "sha256:" + "0" * 63,
    "sha256:" + "0" * 65,
    "sha256:" + "0" * 64 + "\n",
    "md5:" + "0" * 64,
    "0" * 64,
    "sha256:" + "0" * 32 + "*" + "0" * 31,
]


@pytest.mark.parametrize("bad", BAD_KEYS)
async def test_malformed_keys_are_refused(harness: Harness, bad: str) -> None:
    key = BlobKey(bad)
    with pytest.raises(InvalidBlobKeyError) as info:
        await harness.store.get(key)
    assert info.value.key == bad
    with pytest.raises(InvalidBlobKeyError):
        await collect(harness.store.get_stream(key))
    with pytest.raises(InvalidBlobKeyError):
        await harness.store.contains(key)
    with pytest.raises(InvalidBlobKeyError):
        await harness.store.delete(key)
