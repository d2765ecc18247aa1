"""The ``ObjectStore`` interface: content-addressed, immutable blobs."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Protocol, runtime_checkable

from nbos.core.config import StoreSettings
from nbos.core.ids import BlobKey


@runtime_checkable
class ObjectStore(Protocol):
    """Stores blobs under the SHA-256 of their content.

    Contract, shared by every implementation and checked by one test suite:

    * **Content addressing.** A blob's key is ``"sha256:" + hexdigest(content)``,
      so writing the same bytes twice stores them once, and ``put`` of a blob
      that already exists is cheap and succeeds.
    * **Atomicity.** A crash or cancellation in the middle of a ``put`` leaves no
      blob under the final key: readers see the whole blob or
      :class:`~nbos.core.errors.BlobNotFoundError`, never part of one.
    * **Streaming.** ``put_stream`` and ``get_stream`` hold at most a bounded
      number of chunks in memory, so a blob larger than memory can pass through.
    * **Integrity.** ``get`` and ``get_stream`` verify the content against the key
      and raise :class:`~nbos.core.errors.BlobCorruptError` on mismatch.
    * **Errors.** A missing key raises ``BlobNotFoundError``; an unreachable
      backing service raises :class:`~nbos.core.errors.StoreError`.
    """

    async def put(self, data: bytes) -> BlobKey:
        """Store ``data``; returns its key."""
        ...

    async def put_stream(self, chunks: AsyncIterable[bytes]) -> BlobKey:
        """Store the concatenation of ``chunks`` without holding it all in memory."""
        ...

    async def get(self, key: BlobKey) -> bytes:
        """Return the whole blob."""
        ...

    def get_stream(self, key: BlobKey, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """Yield the blob in chunks of at most ``chunk_size`` bytes."""
        ...

    async def contains(self, key: BlobKey) -> bool:
        """Whether a blob is stored under ``key``."""
        ...

    async def delete(self, key: BlobKey) -> None:
        """Remove the blob; deleting a missing key is not an error."""
        ...

    async def aclose(self) -> None:
        """Release connections and file handles."""
        ...


@runtime_checkable
class StoreFactory(Protocol):
    """What an ``nbos.object_stores`` entry point names: usually the store class itself."""

    def from_settings(self, settings: StoreSettings) -> ObjectStore:
        """A store configured by ``settings``; raises ``ConfigError`` for bad settings."""
        ...
