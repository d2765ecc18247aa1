"""Re-slicing byte streams into chunks of a fixed size without buffering the whole stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator

from nbos.core.errors import StoreError

logger = logging.getLogger(__name__)


async def rechunk(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Yield the concatenation of ``chunks`` in pieces of exactly ``size`` bytes (the last may
    be shorter, and no empty piece is yielded).

    Holds at most one input chunk plus one output piece: a large input chunk is sliced
    through a memoryview rather than copied into a buffer.
    """
    pending = bytearray()
    async for chunk in chunks:
        view = memoryview(chunk)
        if pending:
            take = size - len(pending)
            pending += view[:take]
            view = view[take:]
            if len(pending) < size:
                continue
            yield bytes(pending)
            pending.clear()
        while len(view) >= size:
            yield bytes(view[:size])
            view = view[size:]
        pending += view
    if pending:
        yield bytes(pending)


def check_chunk_size(size: int) -> None:
    """Refuse a chunk size that could never make progress."""
    if size <= 0:
        logger.warning("refused chunk size %d", size)
        raise StoreError(f"chunk_size must be a positive number of bytes, got {size}")
