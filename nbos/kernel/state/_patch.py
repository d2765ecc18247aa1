"""A large buffer stored as the pages written since its previous version.

When a tracked buffer was written on a few of its pages since the capture that stored
it, the next capture stores a patch instead of the whole buffer again: a reference to
that previous version, the buffer's size, and the written byte ranges with their new
bytes. One element written into a 500 MB array then adds a page or two to the object
store, not 500 MB, and the capture reads those pages only.

A patch is referred to as :data:`PATCH_PREFIX` followed by the key of the blob that
holds it, where a whole buffer is referred to by its blob key: a reader knows from the
reference alone which it has, never from the bytes. Reading rebuilds the base (a
whole blob at the end of a chain of at most :data:`MAX_DEPTH` patches, or a copy of a
version this process holds already: :mod:`._held`) and writes each patch's ranges over
it, oldest first.

A capture stores the whole buffer again once the patches since the last whole version
would hold more than :data:`MAX_SHARE` of the buffer's bytes, or number more than
:data:`MAX_DEPTH`: reading a buffer then costs at most an eighth more bytes than reading
it whole, in a bounded number of small reads, and a heavily written buffer costs what it
did without patches. A buffer written one element per cell is stored whole once every
:data:`MAX_DEPTH` cells.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec

from nbos.core.errors import StoreError
from nbos.core.ids import BLOB_KEY_PREFIX, BlobKey
from nbos.core.object_store import ObjectStore

#: What a patch's reference starts with; the blob key of the patch follows.
PATCH_PREFIX = "patch+"
#: Patches at most between a reference and the whole blob it builds on.
MAX_DEPTH = 256
#: The patches since a whole version hold at most this share of the buffer's bytes.
MAX_SHARE = 0.125

_LENGTH = struct.Struct(">I")

B = TypeVar("B", bound=bytearray)


class Patch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A buffer of ``nbytes`` bytes: ``base``'s bytes with ``ranges`` written over them.

    ``ranges`` are ``(offset, length)`` pairs in ascending, disjoint order; their new
    bytes follow the patch's header in the blob, in the same order.
    """

    base: str
    nbytes: int
    ranges: list[tuple[int, int]]


def is_patch(ref: str) -> bool:
    """Whether ``ref`` refers to a patch rather than to a whole buffer's blob."""
    return ref.startswith(PATCH_PREFIX + BLOB_KEY_PREFIX)


def is_reference(ref: str) -> bool:
    """Whether ``ref`` is a buffer reference at all: a blob key or a patch's reference."""
    return ref.startswith(BLOB_KEY_PREFIX) or is_patch(ref)


def reference(blob: BlobKey) -> BlobKey:
    """The reference of the patch stored under ``blob``."""
    return BlobKey(PATCH_PREFIX + blob)


def blob_of(ref: str) -> BlobKey:
    """The blob key that holds the patch ``ref`` refers to."""
    return BlobKey(ref.removeprefix(PATCH_PREFIX))


def parts(
    base: str, nbytes: int, ranges: Sequence[tuple[int, int]], pieces: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """The bytes of a patch blob, as pieces to store in one pass: header, then ``pieces``."""
    header = msgspec.msgpack.encode(Patch(base, nbytes, list(ranges)))
    return [_LENGTH.pack(len(header)) + header, *pieces]


async def rebuild(
    store: ObjectStore,
    ref: str,
    whole: Callable[[ObjectStore, BlobKey], Awaitable[B]],
    held: Callable[[str], Awaitable[B | None]],
    write: Callable[[B, int, memoryview], None] | None = None,
) -> B:
    """The bytes of the buffer ``ref`` refers to: from the first buffer of its chain that
    ``held`` has a copy of, else from the whole blob that ``whole`` reads; ``write``
    (offset, bytes) writes each patched range, where the caller keeps what it overwrites."""
    chain: list[tuple[Patch, memoryview]] = []
    while (out := await held(ref)) is None and is_patch(ref):
        if len(chain) == MAX_DEPTH:
            raise StoreError(f"buffer {ref} builds on more than {MAX_DEPTH} patches")
        blob = blob_of(ref)
        patch, body = _parse(blob, await store.get(blob))
        chain.append((patch, body))
        ref = patch.base
    if out is None:
        if not ref.startswith(BLOB_KEY_PREFIX):
            raise StoreError(f"a patch builds on {ref!r}, which is no buffer reference")
        out = await whole(store, BlobKey(ref))
    for patch, body in reversed(chain):
        if len(out) != patch.nbytes:
            raise StoreError(f"a patch of {patch.nbytes} bytes builds on {len(out)} bytes")
        position = 0
        for offset, length in patch.ranges:
            piece = body[position : position + length]
            if write is None:
                out[offset : offset + length] = piece
            else:
                write(out, offset, piece)
            position += length
    return out


def _parse(blob: BlobKey, data: bytes) -> tuple[Patch, memoryview]:
    """A patch blob's header and the new bytes that follow it, checked for consistency."""
    view = memoryview(data)
    try:
        (length,) = _LENGTH.unpack_from(view)
        patch = msgspec.msgpack.decode(view[_LENGTH.size : _LENGTH.size + length], type=Patch)
    except (struct.error, msgspec.DecodeError) as exc:
        raise StoreError(f"patch blob {blob} is malformed: {exc}") from exc
    body = view[_LENGTH.size + length :]
    end = 0
    for offset, size in patch.ranges:
        if offset < end or size <= 0 or offset + size > patch.nbytes:
            raise StoreError(f"patch blob {blob} has a bad range ({offset}, {size})")
        end = offset + size
    if sum(size for _, size in patch.ranges) != len(body):
        raise StoreError(f"patch blob {blob} holds {len(body)} bytes, not what its ranges say")
    return patch, body
