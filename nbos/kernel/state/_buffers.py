"""Large out-of-band buffers as content-addressed blobs, written once.

A pickle's out-of-band buffers of ``threshold`` bytes or more become blobs keyed by
the SHA-256 of their bytes (the object store's own addressing, so a key computed
here is the key the store files it under). Knowing a buffer's key means hashing it,
which for a 1 GB array costs about half a second; :class:`BufferKeys` avoids that for
buffers no one wrote to since the previous capture:

* with Linux soft-dirty page bits (:mod:`._pages`), a buffer at the same address
  and size, whose owner is still alive and none of whose pages were written since
  the previous capture, has the same bytes, hence the same key: reading its page
  flags costs about 2 ms per GB. Any write, through any alias, sets the bits.
* without them every large buffer is hashed on every capture: slower, never wrong.

No version counter is used for torch tensors: ``tensor.data.add_()`` and writes
through ``tensor.numpy()`` do not bump ``tensor._version``.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import weakref
from collections.abc import AsyncIterator, Callable

import anyio.to_thread

from nbos.core.errors import StoreError
from nbos.core.ids import BLOB_KEY_PREFIX, BlobKey
from nbos.core.object_store import ObjectStore
from nbos.kernel.state._pages import PageWrites

log = logging.getLogger(__name__)

#: Buffers (and pickles) of this many bytes or more go to the object store.
LARGE = 1 << 20
# Chunks of a blob on its way to or from the store: large enough that the per-chunk
# thread hop of a store is noise, small enough to bound the copy held in memory.
_CHUNK = 16 << 20


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


class _Known:
    """The key of the bytes at one address, valid while ``owner`` lives and no page is written."""

    __slots__ = ("key", "owner")

    def __init__(self, owner: Callable[[], object], key: BlobKey) -> None:
        self.owner = owner
        self.key = key


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
        """Keep only entries whose owner lives and whose pages were not written."""
        self._known = {
            place: entry
            for place, entry in self._known.items()
            if entry.owner() is not None and not pages.written(*place)
        }

    async def keys(
        self, buffers: list[pickle.PickleBuffer], owners: dict[int, object]
    ) -> dict[tuple[int, int], BlobKey]:
        """Map each buffer's ``(address, nbytes)`` to its key.

        ``owners`` maps ``id(exporter)`` to the object that owns an exporter's memory
        when the exporter is a temporary (a tensor's numpy view).
        """
        views = {_place(view): view for view in (b.raw() for b in buffers)}
        if self._pages is None:
            self._known.clear()
        else:
            # The clear first has every watcher, this one included, drop entries whose
            # pages were written; writes after it are seen by the next capture.
            self._pages.clear()
        found: dict[tuple[int, int], BlobKey] = {}
        known: dict[tuple[int, int], _Known] = {}
        self.hashed_bytes = 0
        for place, view in views.items():
            entry_or_none = self._known.get(place)
            if entry_or_none is not None and entry_or_none.owner() is not None:
                entry = entry_or_none
            else:
                key = await hash_key(view)
                self.hashed_bytes += view.nbytes
                entry = _Known(_weak_owner(view, owners), key)
            found[place] = entry.key
            if entry.owner() is not None and place[0] > 0:
                known[place] = entry
        self._known = known  # forget buffers that left the namespace: frees their owners' refs
        return found


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


async def hash_key(view: memoryview) -> BlobKey:
    """The blob key of ``view``'s bytes, hashed off the event loop (hashlib drops the GIL)."""
    return await anyio.to_thread.run_sync(_sha256_key, view)


def _sha256_key(view: memoryview) -> BlobKey:
    return BlobKey(BLOB_KEY_PREFIX + hashlib.sha256(view).hexdigest())


async def upload(store: ObjectStore, view: memoryview, key: BlobKey) -> None:
    """Write ``view`` under ``key`` unless the store has it; checks the store agrees on the key."""
    if await store.contains(key):
        return
    stored = await store.put_stream(_chunks(view))
    if stored != key:
        # The buffer changed while it was written (a concurrent writer), or the store is broken.
        log.error("object store filed a buffer under %s, expected %s", stored, key)
        raise StoreError(f"buffer expected under {key} was stored under {stored}")


async def _chunks(view: memoryview) -> AsyncIterator[bytes]:
    for start in range(0, view.nbytes, _CHUNK):
        yield bytes(view[start : start + _CHUNK])


async def fetch(store: ObjectStore, key: BlobKey) -> bytearray:
    """The blob under ``key`` as a writable buffer (arrays rebuilt on it stay writable)."""
    out = bytearray()
    async for chunk in store.get_stream(key, _CHUNK):
        out += chunk
    return out
