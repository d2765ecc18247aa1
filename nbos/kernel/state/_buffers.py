"""Large out-of-band buffers as content-addressed blobs, read once on their way out.

A pickle's out-of-band buffers of ``threshold`` bytes or more become blobs keyed by
the SHA-256 of their bytes (the object store's own addressing). Knowing a buffer's
key means hashing it, which for a 1 GB array costs about half a second;
:class:`BufferKeys` avoids that for buffers no one wrote to since the previous capture:

* with a page-write tracker (:mod:`._pages`: soft-dirty bits, else write-protect
  userfaultfd), a buffer at the same address and size, whose owner is still alive
  and none of whose pages were written since the previous capture, has the same
  bytes, hence the same key: asking costs microseconds to milliseconds per GB. Any
  write, through any alias, is seen; a buffer is armed for tracking before its bytes
  are read, so a write made while it is hashed is seen by the next capture.
* without one every large buffer is hashed on every capture, but in parallel: its
  8 MiB chunks are hashed on all cores and the chunk digests compared with the
  previous capture's; only a buffer whose chunks changed is read again. Slower than
  page tracking, never wrong.

A buffer that must be hashed and will be sent is streamed into the object store in
the same pass (:func:`store_buffer`): the store's own hash is its key, so its bytes
are read and hashed once, straight from memory, with no intermediate copy. With page
tracking, a buffer written on a few pages since it was stored is stored as a patch
of those pages over its previous version (:mod:`._patch`), so a buffer's reference is
a blob key or a patch's reference.

No version counter is used for torch tensors: ``tensor.data.add_()`` and writes
through ``tensor.numpy()`` do not bump ``tensor._version``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import pickle
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol, runtime_checkable

import anyio
import anyio.to_thread

from nbos.core.errors import StoreError
from nbos.core.ids import BLOB_KEY_PREFIX, BlobKey
from nbos.core.object_store import ObjectStore
from nbos.kernel.state import _patch
from nbos.kernel.state._held import StoreBuffer, held_buffers
from nbos.kernel.state._inplace import InPlace
from nbos.kernel.state._page_writes import PageWrites, Span
from nbos.kernel.state._uffd import merged

log = logging.getLogger(__name__)

#: Buffers (and pickles) of this many bytes or more go to the object store.
LARGE = 1 << 20
# Chunks of a blob on its way to or from the store: large enough that the per-chunk
# thread hop of a store is noise, small enough to bound the copy held in memory.
_CHUNK = 16 << 20
# Chunks hashed in parallel to tell whether a buffer changed where there are no page
# bits; hashlib releases the GIL on buffers this large, so threads use every core.
_DIGEST_CHUNK = 8 << 20


class BufferCollector:
    """A ``buffer_callback`` that keeps large buffers out of band and small ones in band."""

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold
        self.buffers: list[pickle.PickleBuffer] = []

    def __call__(self, buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < self._threshold:
            return True
        self.buffers.append(buffer)
        return False


Parts = list[bytes | memoryview]  # a buffer's bytes, as consecutive pieces
# Where a buffer shares its first or last page with other data: (address, its bytes there).
Edges = tuple[tuple[int, bytes], ...]


class _Known:
    """The key of the bytes at one address, valid while ``owner`` lives and either no page
    was written or the bytes still have digest ``chunks``.

    With page tracking, ``edges`` holds the buffer's bytes on the pages it shares with
    other data as they were hashed: those pages are judged by these bytes, not by their
    page bits, so writes to neighbouring data (frequent on the heap) force no rehash.
    ``written`` is ``None`` while the bytes are those of ``key``; else the whole pages
    written since (a patch judges the shared pages by their bytes, as above). ``depth``
    is how many patches ``key`` builds on, ``patched`` how many bytes they hold together.
    """

    __slots__ = ("chunks", "depth", "edges", "key", "owner", "patched", "written")

    def __init__(
        self,
        owner: Callable[[], object],
        key: BlobKey,
        chunks: bytes,
        edges: Edges = (),
        *,
        depth: int = 0,
        patched: int = 0,
    ) -> None:
        self.owner = owner
        self.key = key
        self.chunks = chunks
        self.edges = edges
        self.depth = depth
        self.patched = patched
        self.written: list[Span] | None = None


class BufferKeys:
    """Blob keys of large buffers, with the cheap unchanged-buffer check described above.

    Call :meth:`keys` once per capture with every large buffer of that capture.
    Several instances may share one process's page bits: each drops the entries
    whose pages were written whenever any of them clears the bits.
    """

    def __init__(self, pages: PageWrites | None) -> None:
        self._pages = pages
        self._known: dict[tuple[int, int], _Known] = {}
        self.hashed_bytes = 0  # for tests and measurements: how much the last call hashed
        if pages is not None:
            pages.watch(self)

    def before_clear(self, pages: PageWrites) -> None:
        """Keep the entries whose owner lives: as they are where no byte was written,
        with the pages written added where the tracker tells which."""
        known: dict[tuple[int, int], _Known] = {}
        for place, entry in self._known.items():
            if entry.owner() is None:
                continue
            if entry.written is None and _unwritten(pages, place, entry.edges):
                known[place] = entry
            elif (spans := _written_pages(pages, place)) is not None:
                entry.written = merged([*(entry.written or ()), *spans], place[0], sum(place))
                known[place] = entry
        self._known = known

    async def keys(
        self,
        buffers: list[pickle.PickleBuffer],
        owners: dict[int, object],
        store: ObjectStore | None = None,
    ) -> dict[tuple[int, int], BlobKey]:
        """Map each buffer's ``(address, nbytes)`` to its key.

        ``owners`` maps ``id(exporter)`` to the object that owns an exporter's memory
        when the exporter is a temporary (a tensor's numpy view). With ``store``, a
        buffer that has to be hashed is written to it in the same pass (its key is
        the one the store files it under), so uploading it later costs a lookup.
        """
        views = {_place(view): view for view in (b.raw() for b in buffers)}
        if self._pages is not None:
            # The clear first has every watcher, this one included, drop entries whose
            # pages were written; writes after it are seen by the next capture.
            self._pages.clear()
        found: dict[tuple[int, int], BlobKey] = {}
        known: dict[tuple[int, int], _Known] = {}
        self.hashed_bytes = 0
        for place, view in views.items():
            entry = await self._entry(place, view, owners, store)
            found[place] = entry.key
            if entry.owner() is not None and place[0] > 0:
                known[place] = entry
        self._known = known  # forget buffers that left the namespace: frees their owners' refs
        return found

    async def _entry(
        self,
        place: tuple[int, int],
        view: memoryview,
        owners: dict[int, object],
        store: ObjectStore | None,
    ) -> _Known:
        known = self._known.get(place)
        if known is not None and known.owner() is None:
            known = None
        if known is not None and self._pages is not None:
            if known.written is None:
                return known  # survived the clear: no page written
            if store is not None and (patched := await self._patch(known, view, store)):
                return patched
        if known is None and (held := self._held(place, view, owners)) is not None:
            return held
        self.hashed_bytes += view.nbytes
        owner = _weak_owner(view, owners)
        edges: Edges = ()
        if self._pages is not None:
            # Armed before the bytes are read: a write from now on shows at the next clear.
            # With page tracking a surviving entry was returned above, so this buffer was
            # written: chunk digests would only delay the key it needs.
            if place[0] > 0:
                self._pages.track(*place, owner)
                edges = _edges(view, place[0])
            chunks = b""
        else:
            chunks = await chunk_digest(view)
            if known is not None and chunks == known.chunks:
                return known
        # The shared pages' bytes are hashed from the copies kept, so that the entry
        # vouches for exactly what a later comparison with the copies checks.
        parts = _spliced(view, place[0], edges)
        key = await (hash_key(parts) if store is None else store_buffer(store, parts))
        return _Known(owner, key, chunks, edges)

    def _held(
        self, place: tuple[int, int], view: memoryview, owners: dict[int, object]
    ) -> _Known | None:
        """An entry for a buffer read from the store and held unwritten since (a replica's
        array as it applied it): its reference is known without hashing."""
        held = held_buffers() if self._pages is not None and place[0] > 0 else None
        ref = None if held is None else held.ref_at(*place)
        if self._pages is None or ref is None:
            return None
        owner = _weak_owner(view, owners)
        self._pages.track(*place, owner)
        return _Known(owner, BlobKey(ref), b"", _edges(view, place[0]))

    async def _patch(self, known: _Known, view: memoryview, store: ObjectStore) -> _Known | None:
        """``known``'s buffer stored as a patch of its written pages over ``known.key``;
        ``None`` where it is better stored whole (a long chain, many pages written)."""
        written = known.written or []
        address = _place(view)[0]
        edges = _edges(view, address)
        changed = [edge for edge in edges if edge not in known.edges]
        size = sum(end - start for start, end in written) + sum(len(copy) for _, copy in changed)
        if known.depth >= _patch.MAX_DEPTH:
            return None
        if known.patched + size > view.nbytes * _patch.MAX_SHARE:
            return None
        pieces = sorted(
            [(low, len(copy), copy) for low, copy in changed]
            + [
                (start, end - start, view[start - address : end - address])
                for start, end in written
            ],
            key=lambda piece: piece[0],
        )
        ranges = [(low - address, length) for low, length, _ in pieces]
        blob = await store_buffer(
            store, _patch.parts(known.key, view.nbytes, ranges, [data for *_, data in pieces])
        )
        self.hashed_bytes += size
        ref = _patch.reference(blob)
        return _Known(
            known.owner, ref, b"", edges, depth=known.depth + 1, patched=known.patched + size
        )


def _written_pages(pages: PageWrites, place: tuple[int, int]) -> list[Span] | None:
    """The written spans among the pages that lie wholly inside the buffer at ``place``."""
    page = mmap.PAGESIZE
    address, nbytes = place
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    return pages.written_spans(start, end - start) if end > start else []


def _edges(view: memoryview, address: int) -> Edges:
    """Copies of ``view``'s bytes on its first and last page where those are partial."""
    page = mmap.PAGESIZE
    end = address + view.nbytes
    head_end = min(end, -(-address // page) * page)
    tail_start = max(head_end, end // page * page)
    pieces = ((address, head_end), (tail_start, end if end % page else tail_start))
    return tuple(
        (low, view[low - address : high - address].tobytes()) for low, high in pieces if low < high
    )


def _spliced(view: memoryview, address: int, edges: Edges) -> Parts:
    """``view``'s bytes as pieces, with the copies in ``edges`` in place of the live bytes."""
    parts: Parts = []
    position = 0
    for low, copy in edges:
        offset = low - address
        if offset > position:
            parts.append(view[position:offset])
        parts.append(copy)
        position = offset + len(copy)
    if position < view.nbytes or not parts:
        parts.append(view[position:])
    return parts


def _unwritten(pages: PageWrites, place: tuple[int, int], edges: Edges) -> bool:
    """Whether the buffer at ``place`` holds what was hashed: its whole pages unwritten,
    and its bytes on shared pages equal to the copies taken."""
    page = mmap.PAGESIZE
    address, nbytes = place
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    if end > start and pages.written(start, end - start):
        return False
    return all(_memory(low, len(copy)) == copy for low, copy in edges)


def _memory(address: int, nbytes: int) -> bytes | None:
    """The process's bytes at ``address``, or ``None`` where nothing is mapped.

    Read through ``/proc/self/mem``: an owner can outlive the memory it exported
    (``ndarray.resize(refcheck=False)``), and reading that directly would crash.
    """
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.pread(fd, nbytes, address)
    except OSError:
        return None
    finally:
        os.close(fd)


def place_of(buffer: pickle.PickleBuffer) -> tuple[int, int]:
    """Where a buffer lies: ``(address, nbytes)``.

    An exporter that does not tell its address (not a numpy array) gets the negative
    of its ``id()`` instead: distinct from every other live buffer, and never trusted
    across captures.
    """
    return _place(buffer.raw())


def _place(view: memoryview) -> tuple[int, int]:
    interface = getattr(view.obj, "__array_interface__", None)
    if isinstance(interface, dict) and interface.get("data"):
        return interface["data"][0], view.nbytes
    return -id(view.obj), view.nbytes


def _weak_owner(view: memoryview, owners: dict[int, object]) -> Callable[[], object]:
    owner = owners.get(id(view.obj), view.obj)
    try:
        return weakref.ref(owner)
    except TypeError:  # not weak-referenceable: never trusted across captures
        return _dead


def _dead() -> None:
    return None


async def chunk_digest(view: memoryview) -> bytes:
    """A digest of ``view`` made of its chunks' SHA-256s, hashed on all cores at once."""
    starts = range(0, view.nbytes, _DIGEST_CHUNK)
    digests: list[bytes] = [b""] * len(starts)
    hashers = anyio.CapacityLimiter(os.cpu_count() or 1)

    async def digest(index: int, start: int) -> None:
        chunk = view[start : start + _DIGEST_CHUNK]
        digests[index] = await anyio.to_thread.run_sync(_sha256, chunk, limiter=hashers)

    async with anyio.create_task_group() as tg:
        for index, start in enumerate(starts):
            tg.start_soon(digest, index, start)
    return b"".join(digests)


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


async def hash_key(parts: Parts) -> BlobKey:
    """The blob key of the concatenation of ``parts``, hashed off the event loop
    (hashlib drops the GIL)."""
    return await anyio.to_thread.run_sync(_sha256_key, parts)


def _sha256_key(parts: Parts) -> BlobKey:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return BlobKey(BLOB_KEY_PREFIX + hasher.hexdigest())


async def upload(store: ObjectStore, view: memoryview, key: BlobKey) -> None:
    """Write ``view`` under ``key`` unless the store has it; checks the store agrees on the key.

    A patch was stored when it was made: the store must have it already.
    """
    if _patch.is_patch(key):
        if not await store.contains(_patch.blob_of(key)):
            raise StoreError(f"the patch {key} of a buffer is missing from the object store")
        return
    if await store.contains(key):
        return
    stored = await store_buffer(store, [view])
    if stored != key:
        # The buffer changed while it was written (a concurrent writer), or the store is broken.
        log.error("object store filed a buffer under %s, expected %s", stored, key)
        raise StoreError(f"buffer expected under {key} was stored under {stored}")


@runtime_checkable
class BufferSink(Protocol):
    """A store that takes buffers in place (:meth:`LocalObjectStore.put_buffer`)."""

    async def put_buffer(self, parts: Sequence[bytes | memoryview]) -> BlobKey:
        """Store the concatenation of ``parts``, reading each byte once; returns its key."""
        ...


async def store_buffer(store: ObjectStore, parts: Parts) -> BlobKey:
    """Write the concatenation of ``parts`` to ``store`` in one pass; the key it filed it under.

    A store that takes buffers in place reads them where they are; any other gets
    bounded copies, as its ``put_stream`` contract asks for ``bytes``.
    """
    if isinstance(store, BufferSink):
        return await store.put_buffer(parts)
    return await store.put_stream(_chunks(parts))


async def _chunks(parts: Parts) -> AsyncIterator[bytes]:
    for part in parts:
        view = memoryview(part)
        for start in range(0, view.nbytes, _CHUNK):
            yield view[start : start + _CHUNK].tobytes()


async def fetch(store: ObjectStore, ref: BlobKey, in_place: InPlace | None = None) -> bytearray:
    """The buffer ``ref`` refers to (a blob key or a patch's reference) as a writable
    buffer (arrays rebuilt on it stay writable); with ``in_place``, a patch may be
    written over the held version it builds on (:mod:`._inplace`)."""
    held = held_buffers()
    if held is None:
        return await _patch.rebuild(store, ref, _fetch_whole, _nothing_held)
    if in_place is None:
        out = await _patch.rebuild(store, ref, _fetch_whole, held.base)
    else:
        base = functools.partial(held.base, in_place=in_place)
        out = await _patch.rebuild(store, ref, _fetch_whole, base, in_place.write)
        if in_place.took(out):
            held.rearm()
    held.hold(ref, out)
    return out


async def _nothing_held(ref: str) -> None:
    return None


async def _fetch_whole(store: ObjectStore, key: BlobKey) -> StoreBuffer:
    out = StoreBuffer()
    async for chunk in store.get_stream(key, _CHUNK):
        out += chunk
    return out
