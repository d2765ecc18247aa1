"""Child process of test_crash.py: starts writing a large blob and never finishes.

Usage: ``python _crash_writer.py local ROOT`` or ``python _crash_writer.py redis URL``.
Prints ``writing`` once several chunks are stored, then keeps streaming (and finally
stalls) until the parent kills it with SIGKILL.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from nbos.core.object_store import ObjectStore
from nbos.store import LocalObjectStore, RedisObjectStore

CHUNK = 1 << 20
CHUNKS = 64
READY_AFTER = 4
#: Short, so that the parent can watch a dead writer's part hash expire.
PART_TTL_S = 1


def open_store(kind: str, where: str) -> ObjectStore:
    if kind == "local":
        return LocalObjectStore(Path(where))
    return RedisObjectStore(where, chunk_bytes=CHUNK // 4, part_ttl_s=PART_TTL_S)


async def endless() -> AsyncIterator[bytes]:
    for i in range(CHUNKS):
        if i == READY_AFTER:  # chunks 0..READY_AFTER-1 have been handed to the store
            print("writing", flush=True)
        yield bytes([i % 256]) * CHUNK
    await anyio.sleep_forever()


async def main(kind: str, where: str) -> None:
    await open_store(kind, where).put_stream(endless())


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
