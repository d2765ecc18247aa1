"""Which memory was written since a point in time: soft-dirty bits, else userfaultfd.

Writing ``4`` to ``/proc/self/clear_refs`` clears the soft-dirty bit of every page of
the process; the kernel sets it again on the first write to a page, whoever writes
(numpy, torch, C extensions, views, ``.data``). Bit 55 of a page's 64-bit entry in
``/proc/self/pagemap`` reads it. This is what lets an untouched 1 GB array be
recognised as unchanged by reading 2 MB of page flags instead of hashing 1 GB.

It needs a kernel built with ``CONFIG_MEM_SOFT_DIRTY`` (most distribution kernels;
not every VM kernel): :func:`probe` checks that the bits really work, and otherwise
tries write-protect userfaultfd (:mod:`._uffd`, Linux 6.7+), which tracks only the
buffers armed through :meth:`PageWrites.track`; with neither it returns ``None`` and
callers fall back to hashing.

Known limits, all of them false alarms except the last: a clear write-protects every
page (userfaultfd: every tracked page), so the first write to a page after a capture
takes a minor fault; pages that share a buffer's first or last page with other data
read as written when that data is (``BufferKeys`` judges those pages by bytes
instead); a region unmapped with ``MADV_DONTNEED`` after a clear reads as clean
though it now reads as zeros (no Python code path in numpy or torch does this to a
live buffer).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import weakref
from collections.abc import Callable

from nbos.kernel.state._page_writes import PageWrites, Span, Watcher
from nbos.kernel.state._uffd import open_uffd

log = logging.getLogger(__name__)

_CLEAR_REFS = "/proc/self/clear_refs"
_PAGEMAP = "/proc/self/pagemap"
_ENTRY = struct.Struct("<Q")
_DIRTY_BYTE = 55 // 8
_TOP_BIT = bytes(1 if byte & 0x80 else 0 for byte in range(256))


class SoftDirtyPages:
    """Reads and clears the soft-dirty bits of this process's pages (one per process)."""

    def __init__(self) -> None:
        self._page = mmap.PAGESIZE
        self._watchers: weakref.WeakSet[Watcher] = weakref.WeakSet()

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher.before_clear`` before every clear, while ``watcher`` lives."""
        self._watchers.add(watcher)

    def track(self, address: int, nbytes: int, owner: Callable[[], object]) -> bool:
        """Nothing to arm: the kernel keeps the bits of every page."""
        return True

    def clear(self) -> None:
        """Mark every page of the process clean, after the watchers read their bits."""
        for watcher in list(self._watchers):
            watcher.before_clear(self)
        with open(_CLEAR_REFS, "w") as f:
            f.write("4")

    def written(self, address: int, nbytes: int) -> bool:
        """Whether any page of ``[address, address + nbytes)`` was written since :meth:`clear`."""
        if nbytes <= 0:
            return False
        dirty = self._dirty(address, nbytes)
        return dirty is None or b"\x01" in dirty

    def written_spans(self, address: int, nbytes: int) -> list[Span] | None:
        """The written pages of ``[address, address + nbytes)``, as spans clipped to it."""
        if nbytes <= 0:
            return []
        dirty = self._dirty(address, nbytes)
        if dirty is None:
            return None
        first, spans = address // self._page, []
        run = dirty.find(b"\x01")
        while run >= 0:  # runs of set bits, found by C scans rather than a loop per page
            stop = dirty.find(b"\x00", run)
            stop = len(dirty) if stop < 0 else stop
            low = max(address, (first + run) * self._page)
            spans.append((low, min(address + nbytes, (first + stop) * self._page)))
            run = dirty.find(b"\x01", stop)
        return spans

    def _dirty(self, address: int, nbytes: int) -> bytes | None:
        """One byte per page of the range, 1 where the page was written; ``None`` if the
        pagemap does not cover it."""
        first = address // self._page
        count = (address + nbytes - 1) // self._page - first + 1
        with open(_PAGEMAP, "rb", buffering=0) as f:
            f.seek(first * _ENTRY.size)
            entries = f.read(count * _ENTRY.size)
        if len(entries) != count * _ENTRY.size:
            return None
        # Bit 55 is the top bit of byte 6 of each little-endian entry: slice those bytes
        # out and map each to its top bit, all in C (a 1 GB buffer has 262144 entries).
        return entries[_DIRTY_BYTE :: _ENTRY.size].translate(_TOP_BIT)


_probed: list[PageWrites | None] = []
# A forked child probes afresh: a tracker that the parent opened works only for it.
os.register_at_fork(after_in_child=_probed.clear)


def probe() -> PageWrites | None:
    """This process's page-write tracker: :class:`SoftDirtyPages` where the kernel keeps
    the bits, else :class:`~._uffd.UffdPages` where userfaultfd allows it, else ``None``.

    Probed once per process: the probe clears the bits, which is only harmless
    before anyone relies on them.
    """
    if not _probed:
        pages = _probe() or open_uffd()
        _probed.append(pages)
        if pages is None:
            log.info("no page-write tracker: large buffers are hashed after every cell")
        else:
            log.info("page writes tracked by %s", type(pages).__name__)
    return _probed[0]


def _probe() -> SoftDirtyPages | None:
    try:
        pages = SoftDirtyPages()
        region = ctypes.create_string_buffer(mmap.PAGESIZE * 2)
        # The page that lies wholly inside the buffer, so nothing else writes to it.
        address = -(-ctypes.addressof(region) // mmap.PAGESIZE) * mmap.PAGESIZE
        offset = address - ctypes.addressof(region)
        pages.clear()
        clean = not pages.written(address, 1)
        region[offset] = b"x"
        works = clean and pages.written(address, 1)
    except OSError as exc:
        log.info("soft-dirty page bits unavailable (%s)", exc)
        return None
    if not works:
        log.info("this kernel does not keep soft-dirty page bits")
        return None
    return pages
