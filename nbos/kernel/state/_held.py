"""Buffers this process read from the store, reused while no byte of them was written.

A replica applying a patch of a large buffer needs the patch's base, which it usually
rebuilt itself for the previous cell and still holds: the namespace's array is built on
it. Copying that costs a memory copy; reading the base from the store again costs a read
and a SHA-256 of the whole buffer. The page-write tracker vouches that the held copy
still has the bytes it was read with: any write to it, through any alias (a cell run here
after a failover included), drops it. Held weakly: a buffer no value uses any more is
freed as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref

import anyio.lowlevel

from nbos.kernel.state._inplace import InPlace
from nbos.kernel.state._page_writes import PageWrites
from nbos.kernel.state._pages import probe

_SLICE = 16 << 20


class StoreBuffer(bytearray):
    """A buffer read from the object store; unlike ``bytearray``, weakly referable."""

    __slots__ = ("__weakref__",)


class HeldBuffers:
    """The store buffers of this process by reference, each valid while unwritten."""

    def __init__(self, pages: PageWrites) -> None:
        self._pages = pages
        self._held: dict[str, tuple[weakref.ref[StoreBuffer], int, int]] = {}
        pages.watch(self)

    def before_clear(self, pages: PageWrites) -> None:
        """Drop what was written or freed: the bits that tell are about to be cleared."""
        self._held = {
            ref: entry
            for ref, entry in self._held.items()
            if entry[0]() is not None and not pages.written(entry[1], entry[2])
        }

    async def base(self, ref: str, in_place: InPlace | None = None) -> StoreBuffer | None:
        """A buffer to build on with the bytes of ``ref``, if one is held unwritten: a copy
        of it, or (taken by ``in_place``) itself when only replaced values reach it."""
        buffer = self._valid(ref)
        if buffer is None:
            return None
        # 3: its one referrer, `buffer` here and the argument.
        if (
            in_place is not None
            and sys.getrefcount(buffer) == 3
            and in_place.reached_only_by_replaced(buffer)
        ):
            in_place.take(buffer)
            return buffer
        # In slices, yielding between them: one copy of a large buffer would hold the
        # interpreter lock long enough for the Raft thread to miss its heartbeats.
        out = StoreBuffer()
        with memoryview(buffer) as view:
            for start in range(0, len(view), _SLICE):
                out += view[start : start + _SLICE]
                await anyio.lowlevel.checkpoint()
        if self._valid(ref) is not buffer:
            return None  # written while it was copied: the copy may be torn
        return out

    def ref_at(self, address: int, nbytes: int) -> str | None:
        """The reference whose bytes lie at ``[address, address + nbytes)`` unwritten."""
        for ref, (_, held_address, held_nbytes) in list(self._held.items()):
            if (held_address, held_nbytes) == (address, nbytes) and self._valid(ref):
                return ref
        return None

    def _valid(self, ref: str) -> StoreBuffer | None:
        entry = self._held.get(ref)
        if entry is None:
            return None
        owner, address, nbytes = entry
        buffer = owner()
        if buffer is not None and not self._pages.written(address, nbytes):
            return buffer
        del self._held[ref]
        return None

    def rearm(self) -> None:
        """Count the pages written so far as this process's own bytes, not as changes:
        a buffer patched in place holds its new version, to be held unwritten from now."""
        self._pages.clear()

    def hold(self, ref: str, buffer: StoreBuffer) -> None:
        """Remember ``buffer`` as the bytes of ``ref`` until it is written or freed."""
        self._held = {r: e for r, e in self._held.items() if e[0]() is not None}
        if not buffer:
            return
        owner = weakref.ref(buffer)
        address = _address(buffer)
        if self._pages.track(address, len(buffer), owner):
            self._held[ref] = (owner, address, len(buffer))


def _address(buffer: bytearray) -> int:
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the export: the bytearray may be resized again


_held: list[HeldBuffers | None] = []
# A forked child starts afresh: the tracker it probes is its own.
os.register_at_fork(after_in_child=_held.clear)


def held_buffers() -> HeldBuffers | None:
    """This process's held buffers; ``None`` without a page-write tracker."""
    if not _held:
        pages = probe()
        _held.append(None if pages is None else HeldBuffers(pages))
    return _held[0]
