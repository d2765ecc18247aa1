"""An object store in Redis, for clusters whose hosts share no file system.

Layout: the blob with digest ``d`` is one Redis hash, ``<namespace>:blob:<d>``, whose
fields ``"0"``, ``"1"``, ... hold fixed-size chunks and whose fields ``size`` and
``chunks`` describe them; chunking keeps every value far below Redis's 512 MiB limit.

Atomicity: a put writes its chunks into a *part* hash with a random name and a TTL
(refreshed at every chunk), then a Lua script checks that every chunk is there, adds
the description, clears the TTL and renames the part onto the final key, all in one
server-side step. Readers therefore see the whole blob or no key; a writer that
crashes leaves only a part hash, which expires. Blob and part keys are unrelated, so
this store needs a single Redis server (not Redis Cluster, whose RENAME stays in a slot).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit, urlunsplit

import anyio
import redis.asyncio
import redis.exceptions

from nbos.core.config import StoreSettings
from nbos.core.errors import BlobCorruptError, BlobNotFoundError, ConfigError, StoreError
from nbos.core.ids import BlobKey
from nbos.store._chunks import check_chunk_size, rechunk
from nbos.store._keys import digest_of, key_of, new_hasher, verify

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_DISCARD_TIMEOUT_S = 2.0
_SIZE = "size"
_CHUNKS = "chunks"

# KEYS: part, blob. ARGV: size, chunk count. Returns 0 if chunks are missing (the part
# expired during a stall longer than its TTL), so that no incomplete blob is published.
_COMMIT = f"""
if redis.call('HLEN', KEYS[1]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], '{_SIZE}', ARGV[1], '{_CHUNKS}', ARGV[2])
redis.call('PERSIST', KEYS[1])
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""


class RedisObjectStore:
    """An :class:`~nbos.core.object_store.ObjectStore` in one Redis server.

    ``url`` is a redis-py URL (``redis://[:password@]host:port/db``, ``rediss://``,
    ``unix://``); a malformed one raises :class:`ConfigError`. No connection is made
    until the first operation; an unreachable server then raises :class:`StoreError`.
    ``chunk_bytes`` is the size of the stored chunks; ``part_ttl_s`` bounds how long
    a crashed writer's part hash lingers (and the longest stall a writer survives).
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "nbos",
        chunk_bytes: int = 1 << 20,
        part_ttl_s: float = 900.0,
        timeout_s: float = 30.0,
    ) -> None:
        check_chunk_size(chunk_bytes)
        self._where = _redact(url)
        try:
            self._redis = redis.asyncio.Redis.from_url(
                url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
            )
        except ValueError as exc:
            raise ConfigError("store.redis_url", self._where, f"a redis URL ({exc})") from exc
        self._commit = self._redis.register_script(_COMMIT)
        self._namespace = namespace
        self._chunk_bytes = chunk_bytes
        self._part_ttl_s = part_ttl_s
        self._part_ttl_ms = max(1, round(part_ttl_s * 1000))

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> RedisObjectStore:
        """The store at ``settings.redis_url``."""
        return cls(settings.redis_url)

    def blob_name(self, key: BlobKey) -> str:
        """The Redis key of the blob ``key`` (whether or not it is stored)."""
        return f"{self._namespace}:blob:{digest_of(key)}"

    @property
    def part_pattern(self) -> str:
        """A ``SCAN`` pattern matching the part hashes of unfinished writes."""
        return f"{self._namespace}:part:*"

    async def put(self, data: bytes) -> BlobKey:
        """Store ``data``; a blob that is already stored is not written again."""
        key = key_of(new_hasher(data))
        if await self.contains(key):
            return key
        return await self.put_stream(_single(data))

    async def put_stream(self, chunks: AsyncIterable[bytes]) -> BlobKey:
        """Store the concatenation of ``chunks``, one stored chunk in flight at a time."""
        part = f"{self._namespace}:part:{uuid.uuid4().hex}"
        hasher = new_hasher()
        size = count = 0
        committed = False
        try:
            async for chunk in rechunk(chunks, self._chunk_bytes):
                hasher.update(chunk)
                await self._call("writing a chunk", self._write_chunk(part, count, chunk))
                size += len(chunk)
                count += 1
            key = key_of(hasher)
            done = await self._call(
                "publishing a blob",
                self._commit(keys=[part, self.blob_name(key)], args=[size, count]),
            )
            # A retried commit finds its part already renamed: check before giving up.
            if not done and not await self.contains(key):
                raise StoreError(
                    f"blob {key} was not stored: its partial upload expired after "
                    f"a stall of more than {self._part_ttl_s} s"
                )
            committed = True
            return key
        finally:
            if not committed:
                await self._discard(part)

    async def get(self, key: BlobKey) -> bytes:
        """The whole blob, verified against ``key``."""
        return b"".join([chunk async for chunk in self._verified_chunks(key)])

    async def get_stream(self, key: BlobKey, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The blob in chunks of ``chunk_size`` bytes (the last may be shorter).

        The content is verified as it streams: :class:`BlobCorruptError` comes after the
        last chunk, so a consumer must not trust the data until the iteration ends.
        """
        check_chunk_size(chunk_size)
        async for chunk in rechunk(self._verified_chunks(key), chunk_size):
            yield chunk

    async def contains(self, key: BlobKey) -> bool:
        """Whether a blob is stored under ``key`` (without verifying its content)."""
        return await self._call("looking up a blob", self._redis.exists(self.blob_name(key))) > 0

    async def delete(self, key: BlobKey) -> None:
        """Remove the blob; a missing blob is not an error."""
        await self._call("deleting a blob", self._redis.delete(self.blob_name(key)))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()

    async def _write_chunk(self, part: str, index: int, chunk: bytes) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(part, str(index), chunk)
        pipe.pexpire(part, self._part_ttl_ms)
        await pipe.execute()

    async def _verified_chunks(self, key: BlobKey) -> AsyncIterator[bytes]:
        """The stored chunks of ``key``, checked for size and hash after the last one."""
        name = self.blob_name(key)
        raw_size, raw_count = await self._call(
            "reading a blob", self._redis.hmget(name, [_SIZE, _CHUNKS])
        )
        if raw_size is None and raw_count is None:
            raise BlobNotFoundError(key)
        size, count = _parse_count(raw_size, key), _parse_count(raw_count, key)
        hasher = new_hasher()
        seen = 0
        for index in range(count):
            chunk = await self._call("reading a blob", self._redis.hget(name, str(index)))
            if not isinstance(chunk, bytes):
                await self._raise_missing(key, name)
            hasher.update(chunk)
            seen += len(chunk)
            yield chunk
        if seen != size:
            logger.error("blob %s holds %d bytes, its description says %d", key, seen, size)
            raise BlobCorruptError(key)
        verify(hasher, key)

    async def _raise_missing(self, key: BlobKey, name: str) -> NoReturn:
        """A chunk is gone: the blob was deleted while being read, or it is damaged."""
        if not await self._call("reading a blob", self._redis.exists(name)):
            raise BlobNotFoundError(key)
        logger.error("blob %s is missing a chunk", key)
        raise BlobCorruptError(key)

    async def _discard(self, part: str) -> None:
        """Best-effort removal of an unfinished part; its TTL covers a failure here.

        Shielded so that a cancelled put still cleans up, but bounded so that an
        unreachable server cannot hold the cancellation up.
        """
        with anyio.move_on_after(_DISCARD_TIMEOUT_S, shield=True):
            try:
                await self._redis.delete(part)
            except (redis.exceptions.RedisError, OSError) as exc:
                logger.info("left part %s to expire: %s", part, exc)

    async def _call(self, what: str, request: Awaitable[_T]) -> _T:
        with self._errors(what):
            return await request

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            logger.warning("cannot reach redis at %s while %s: %s", self._where, what, exc)
            raise StoreError(f"cannot reach redis at {self._where} while {what}: {exc}") from exc
        except redis.exceptions.RedisError as exc:
            logger.warning("redis at %s failed while %s: %s", self._where, what, exc)
            raise StoreError(f"redis at {self._where} failed while {what}: {exc}") from exc


async def _single(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _parse_count(raw: bytes | str | None, key: BlobKey) -> int:
    """A non-negative count from a blob's description, else the blob is damaged."""
    try:
        value = int(raw) if raw is not None else -1
    except ValueError:
        value = -1
    if value < 0:
        logger.error("blob %s has a malformed description: %r", key, raw)
        raise BlobCorruptError(key)
    return value


def _redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
