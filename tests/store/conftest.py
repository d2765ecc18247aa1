"""Fixtures for the object store tests: a real redis-server, and one harness per store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio

from nbos.core.ids import BlobKey
from nbos.store import LocalObjectStore, RedisObjectStore
from tests._servers._process import serve_or_skip
from tests._servers.redis_server import RedisServer, start_redis
from tests.store._harness import REDIS_CHUNK_BYTES, Harness


@pytest.fixture
def anyio_backend() -> str:
    # redis.asyncio runs on asyncio only.
    return "asyncio"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from serve_or_skip(lambda: start_redis(tmp_path_factory.mktemp("redis")), "a real Redis")


@pytest.fixture
async def redis_raw(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client on an empty database, for looking behind the store's back."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    if request.param == "local":
        made = _local_harness(tmp_path)
        yield made
        await made.store.aclose()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    raw = redis.asyncio.Redis.from_url(server.url)
    await raw.flushdb()
    made = _redis_harness(server, raw)
    try:
        yield made
    finally:
        await made.store.aclose()
        await raw.aclose()


def _local_harness(root: Path) -> Harness:
    store = LocalObjectStore(root)

    async def corrupt(key: BlobKey) -> None:
        with store.path_of(key).open("r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))

    async def leftovers() -> list[str]:
        return sorted(p.name for p in (root / "tmp").iterdir())

    return Harness("local", store, corrupt, leftovers)


def _redis_harness(server: RedisServer, raw: redis.asyncio.Redis) -> Harness:
    store = RedisObjectStore(server.url, chunk_bytes=REDIS_CHUNK_BYTES)

    async def corrupt(key: BlobKey) -> None:
        name = store.blob_name(key)
        first = await raw.hget(name, "0")
        assert isinstance(first, bytes)
        await raw.hset(name, "0", bytes([first[0] ^ 0xFF]) + first[1:])

    async def leftovers() -> list[str]:
        return sorted([k.decode() async for k in raw.scan_iter(match=store.part_pattern)])

    return Harness("redis", store, corrupt, leftovers)
