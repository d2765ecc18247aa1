"""What the contract tests need to know about a store beyond the ObjectStore Protocol."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nbos.core.ids import BlobKey
from nbos.core.object_store import ObjectStore

#: Stored chunk size of the Redis store under test: small, so that blobs of a few hundred
#: KiB already span several chunks.
REDIS_CHUNK_BYTES = 256 << 10


@dataclass
class Harness:
    """A store under test plus the backend-specific ways to inspect and damage it."""

    kind: str
    store: ObjectStore
    #: Change one byte of the stored content of ``key`` (its size stays the same).
    corrupt: Callable[[BlobKey], Awaitable[None]]
    #: Traces of unfinished writes (part files or part hashes); empty when clean.
    leftovers: Callable[[], Awaitable[list[str]]]
