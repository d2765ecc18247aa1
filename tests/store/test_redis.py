"""RedisObjectStore specifics: chunked layout, part expiry, unreachable servers, bad URLs."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
import redis.asyncio

from nbos.core.errors import (
    BlobCorruptError,
    BlobNotFoundError,
    ConfigError,
    StoreError,
)
from nbos.core.ids import BlobKey
from nbos.store import RedisObjectStore
from tests._servers.redis_server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

CHUNK = 64 << 10


@pytest.fixture
async def store(
    redis_server: RedisServer, redis_raw: redis.asyncio.Redis
) -> AsyncIterator[RedisObjectStore]:
    made = RedisObjectStore(redis_server.url, chunk_bytes=CHUNK, part_ttl_s=0.2)
    try:
        yield made
    finally:
        await made.aclose()


async def test_a_blob_is_one_persistent_hash_of_chunks(
    store: RedisObjectStore, redis_raw: redis.asyncio.Redis
) -> None:
    data = bytes(range(256)) * (3 * CHUNK // 256 + 1)
    key = await store.put(data)
    name = store.blob_name(key)
    assert await redis_raw.keys("*") == [name.encode()]
    assert await redis_raw.hlen(name) == 4 + 2  # 4 chunks, size, chunks
    assert await redis_raw.hget(name, "size") == str(len(data)).encode()
    assert await redis_raw.pttl(name) == -1


async def test_a_put_stalled_past_its_part_ttl_fails_without_publishing(
    store: RedisObjectStore, redis_raw: redis.asyncio.Redis
) -> None:
    async def stalls() -> AsyncIterator[bytes]:
        yield b"a" * CHUNK
        await anyio.sleep(0.5)
        yield b"b" * CHUNK

    with pytest.raises(StoreError, match="expired"):
        await store.put_stream(stalls())
    assert await redis_raw.keys("*") == []


async def test_a_damaged_description_is_corruption(
    store: RedisObjectStore, redis_raw: redis.asyncio.Redis
) -> None:
    key = await store.put(b"described")
    await redis_raw.hset(store.blob_name(key), "chunks", "many")
    with pytest.raises(BlobCorruptError):
        await store.get(key)


async def test_a_missing_chunk_is_corruption(
    store: RedisObjectStore, redis_raw: redis.asyncio.Redis
) -> None:
    key = await store.put(b"z" * (2 * CHUNK))
    await redis_raw.hdel(store.blob_name(key), "1")
    with pytest.raises(BlobCorruptError):
        await store.get(key)


async def test_a_blob_deleted_while_streaming_is_not_found(store: RedisObjectStore) -> None:
    key = await store.put(b"q" * (3 * CHUNK))
    stream = store.get_stream(key, chunk_size=CHUNK)
    assert await anext(stream) == b"q" * CHUNK
    await store.delete(key)
    with pytest.raises(BlobNotFoundError):
        async for _ in stream:
            pass


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens once the socket is closed


async def test_an_unreachable_server_is_a_store_error_naming_it_without_password() -> None:
    port = _closed_port()
    store = RedisObjectStore(f"redis://:hunter2@127.0.0.1:{port}/0")
    key = BlobKey("sha256:" + "0" * 64)
    attempts: list[Callable[[], Awaitable[object]]] = [
        lambda: store.get(key),
        lambda: store.contains(key),
        lambda: store.put(b"x"),
        lambda: store.delete(key),
    ]
    try:
        for attempt in attempts:
            with pytest.raises(StoreError, match=f"cannot reach redis at .*:{port}") as info:
                await attempt()
            assert not isinstance(info.value, BlobNotFoundError)
            assert "hunter2" not in str(info.value)
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:6379/0", "127.0.0.1:6379", "redis://127.0.0.1:no-port/0", ""]
)
def test_a_malformed_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisObjectStore(url)
    assert info.value.key == "store.redis_url"
