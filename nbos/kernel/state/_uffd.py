"""Written-page tracking with userfaultfd write-protection, where soft-dirty bits are missing.

A buffer's pages are registered with a userfaultfd in write-protect mode with
``UFFD_FEATURE_WP_ASYNC`` (Linux 6.7+): the first write to a protected page, by any
thread, by user code or by the kernel on the process's behalf (``read()`` into it,
``process_vm_writev``), takes a minor fault that the kernel resolves itself by
dropping the page's protection. The ``PAGEMAP_SCAN`` ioctl then lists the pages that
lost it (``PAGE_IS_WRITTEN``) and protects them again in the same atomic walk
(``PM_SCAN_WP_MATCHING``): reading and re-arming an untouched 1 GB buffer costs
about 0.02 ms, and a write between the two cannot fall through a gap.

Soundness rests on these rules, each preferring a false alarm to a missed write:

* a buffer is tracked (registered, then protected) *before* its bytes are hashed, so
  every write after its key was taken leaves an unprotected page;
* a range is trusted only while it lies inside a tracked span whose owner lives; a
  span covers whole pages, so data sharing a buffer's first or last page (a malloc
  header, a neighbouring object) can only raise false alarms;
* every scan passes ``PM_SCAN_CHECK_WPASYNC``: a range whose registration was lost
  (unmapped and mapped again, moved by ``mremap``) fails the scan and counts as written;
* only private anonymous memory is tracked: pages of a shared mapping can be written
  by another process or through another mapping, which this process's page tables
  never see;
* the descriptors belong to the process that opened them: in a forked child every
  range counts as written (a child scanning through them would re-arm its parent's
  pages and lose the parent's writes).

Not seen, as with soft-dirty bits: writes by a device into pages pinned for DMA before
they were re-protected (``cudaHostRegister``, io_uring fixed buffers), and a range
zeroed by ``MADV_DONTNEED`` while its owner lives.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import threading
import weakref
from collections.abc import Callable, Iterable

from nbos.kernel.state._page_writes import Span, Watcher

log = logging.getLogger(__name__)

_SYSCALL = {"x86_64": 323, "aarch64": 282}
_USER_MODE_ONLY = 1  # lets an unprivileged process in when vm.unprivileged_userfaultfd=0
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13  # protect never-touched pages too
_FEATURE_WP_ASYNC = 1 << 15
_FEATURES = _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_SCAN_WP_MATCHING = 1 << 0
_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_VEC = 256  # written regions fetched per PAGEMAP_SCAN call

_u64 = ctypes.c_uint64


class _Api(ctypes.Structure):
    _fields_ = (("api", _u64), ("features", _u64), ("ioctls", _u64))


class _Range(ctypes.Structure):
    _fields_ = (("start", _u64), ("len", _u64))


class _Register(ctypes.Structure):
    _fields_ = (("range", _Range), ("mode", _u64), ("ioctls", _u64))


class _WriteProtect(ctypes.Structure):
    _fields_ = (("range", _Range), ("mode", _u64))


class _PageRegion(ctypes.Structure):
    _fields_ = (("start", _u64), ("end", _u64), ("categories", _u64))


class _ScanArg(ctypes.Structure):
    _fields_ = tuple(
        (name, _u64)
        for name in (
            "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
            "category_inverted", "category_mask", "category_anyof_mask", "return_mask",
        )
    )  # fmt: skip


def _iowr(kind: int, number: int, size: int, direction: int = 3) -> int:
    """The ioctl request number ``_IOC(direction, kind, number, size)`` (generic layout)."""
    return (direction << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _iowr(_UFFD_API, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(_UFFD_API, 0x00, ctypes.sizeof(_Register))
_UFFDIO_UNREGISTER = _iowr(_UFFD_API, 0x01, ctypes.sizeof(_Range), direction=2)
_UFFDIO_WRITEPROTECT = _iowr(_UFFD_API, 0x06, ctypes.sizeof(_WriteProtect))
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_ScanArg))


class _Tracked:
    """A tracked span and the owners that keep it alive."""

    __slots__ = ("owners",)

    def __init__(self, owner: Callable[[], object]) -> None:
        self.owners = [owner]

    def alive(self) -> bool:
        return any(owner() is not None for owner in self.owners)


class UffdPages:
    """Written pages of tracked buffers, through one userfaultfd (one per process).

    Implements :class:`~nbos.kernel.state._page_writes.PageWrites`; unlike soft-dirty bits it
    sees only what :meth:`track` armed, and :meth:`written` is ``True`` for the rest.
    """

    def __init__(self, uffd: int, pagemap: int) -> None:
        self._uffd = uffd
        self._pagemap = pagemap
        self._pid = os.getpid()
        self._page = mmap.PAGESIZE
        self._lock = threading.RLock()
        self._spans: dict[Span, _Tracked] = {}
        # Written regions found by the last clear's scan, while the watchers read them.
        self._reported: list[Span] = []
        self._watchers: weakref.WeakSet[Watcher] = weakref.WeakSet()
        self._vec = (_PageRegion * _VEC)()

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher.before_clear`` after every scan, while ``watcher`` lives."""
        self._watchers.add(watcher)

    def track(self, address: int, nbytes: int, owner: Callable[[], object]) -> bool:
        """Arm write tracking for the pages of ``[address, address + nbytes)`` while
        ``owner()`` is alive; ``False`` (and the range stays untrusted) if it cannot be.

        Call it before reading the bytes whose writes must be seen.
        """
        if nbytes <= 0 or owner() is None or not self._ours():
            return False
        span = self._span_of(address, nbytes)
        with self._lock:
            self._prune()
            tracked = self._spans.get(span)
            if tracked is not None:  # armed since it was first tracked: nothing to redo
                tracked.owners.append(owner)
                return True
            # Pages that another span shares are armed already and stay as they are:
            # re-arming them would hide that span's writes from the next clear.
            fresh = _subtract(span, self._spans)
            try:
                if not _private_anonymous(span):
                    return False
                for start, end in fresh:
                    piece = _Range(start, end - start)
                    _ioctl(self._uffd, _UFFDIO_REGISTER, _Register(piece, _REGISTER_MODE_WP))
                    protect = _WriteProtect(piece, _WRITEPROTECT_MODE_WP)
                    _ioctl(self._uffd, _UFFDIO_WRITEPROTECT, protect)
            except OSError as exc:
                log.debug("cannot track %#x+%d for writes: %s", address, nbytes, exc)
                self._unregister(fresh)
                return False
            self._spans[span] = _Tracked(owner)
            return True

    def clear(self) -> None:
        """Collect and re-arm the written pages of every tracked span atomically, then let
        the watchers read them; drops spans whose owners died."""
        with self._lock:
            if self._ours():
                self._prune()
                self._reported = self._scan_all()
            try:
                for watcher in list(self._watchers):
                    watcher.before_clear(self)
            finally:
                self._reported = []

    def written(self, address: int, nbytes: int) -> bool:
        """Whether any page of ``[address, address + nbytes)`` may have been written since
        the last :meth:`clear` (always ``True`` outside the tracked spans)."""
        if nbytes <= 0:
            return False
        start, end = self._span_of(address, nbytes)
        with self._lock:
            if not self._tracking(start, end):
                return True
            if any(s < end and start < e for s, e in self._reported):
                return True
            try:  # written since the scan that re-armed it: unprotected now
                return bool(self._scan(start, end, wp=False, limit=1))
            except OSError:
                return True

    def written_spans(self, address: int, nbytes: int) -> list[Span] | None:
        """The written pages of ``[address, address + nbytes)`` since the last clear, as
        spans clipped to it; ``None`` outside the tracked spans."""
        if nbytes <= 0:
            return []
        start, end = self._span_of(address, nbytes)
        with self._lock:
            if not self._tracking(start, end):
                return None
            found = [(s, e) for s, e in self._reported if s < end and start < e]
            try:  # written since the scan that re-armed them: unprotected now
                found += self._scan(start, end, wp=False)
            except OSError:
                return None
        return merged(found, address, address + nbytes)

    def _tracking(self, start: int, end: int) -> bool:
        """Whether a live tracked span of this process covers ``[start, end)``."""
        return self._ours() and any(
            s <= start and end <= e and tracked.alive() for (s, e), tracked in self._spans.items()
        )

    def _span_of(self, address: int, nbytes: int) -> Span:
        page = self._page
        return address // page * page, -(-(address + nbytes) // page) * page

    def _ours(self) -> bool:
        return os.getpid() == self._pid

    def _prune(self) -> None:
        """Forget spans whose owners all died and stop tracking their pages."""
        dead = [span for span, tracked in self._spans.items() if not tracked.alive()]
        for span in dead:
            del self._spans[span]
        for span in dead:
            self._unregister(_subtract(span, self._spans))

    def _unregister(self, spans: Iterable[Span]) -> None:
        for start, end in spans:
            try:  # also drops the protection; the memory may be unmapped already
                _ioctl(self._uffd, _UFFDIO_UNREGISTER, _Range(start, end - start))
            except OSError as exc:
                log.debug("unregistering %#x-%#x: %s", start, end, exc)

    def _scan_all(self) -> list[Span]:
        written: list[Span] = []
        for span in list(self._spans):
            try:
                written += self._scan(*span, wp=True)
            except OSError as exc:
                # The registration is gone: everything in it counts as written, and the
                # span is forgotten so that the next track arms it afresh.
                log.debug("scan of %#x-%#x failed (%s): treated as written", *span, exc)
                written.append(span)
                self._spans.pop(span)
                self._unregister(_subtract(span, self._spans))
        return written

    def _scan(self, start: int, end: int, *, wp: bool, limit: int = 0) -> list[Span]:
        """Written regions of ``[start, end)`` (at least ``limit`` pages' worth if there
        are, all if 0); ``wp`` re-protects them in the same walk."""
        flags = _SCAN_CHECK_WPASYNC | (_SCAN_WP_MATCHING if wp else 0)
        found: list[Span] = []
        vec = ctypes.addressof(self._vec)
        while start < end:
            arg = _ScanArg(ctypes.sizeof(_ScanArg), flags, start, end, 0, vec, _VEC, limit,
                           0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN)  # fmt: skip
            count = _ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            found += [(self._vec[i].start, self._vec[i].end) for i in range(count)]
            if count < _VEC or limit:
                break
            start = arg.walk_end
        return found


def merged(spans: Iterable[Span], low: int, high: int) -> list[Span]:
    """``spans`` clipped to ``[low, high)``, sorted, with overlapping or touching ones joined."""
    out: list[Span] = []
    for start, end in sorted((max(s, low), min(e, high)) for s, e in spans):
        if start >= end:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _ioctl(fd: int, request: int, arg: ctypes.Structure) -> int:
    """``ioctl(fd, request, &arg)``: the kernel fills ``arg`` in place; returns its result."""
    result: int = fcntl.ioctl(fd, request, arg)
    return result


def _subtract(span: Span, others: Iterable[Span]) -> list[Span]:
    """The parts of ``span`` outside every span of ``others``."""
    parts = [span]
    for o_start, o_end in others:
        parts = [
            piece
            for start, end in parts
            for piece in ((start, min(end, o_start)), (max(start, o_end), end))
            if piece[0] < piece[1]
        ]
    return parts


def _private_anonymous(span: Span) -> bool:
    """Whether the mappings of ``span`` are all private and anonymous (and cover it)."""
    start, end = span
    covered = start
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, _, high = fields[0].partition(b"-")
            v_start, v_end = int(low, 16), int(high, 16)
            if v_end <= start or v_start >= end:
                continue
            path = fields[5].strip() if len(fields) > 5 else b""
            anonymous = not path or path == b"[heap]" or path.startswith(b"[anon:")
            if v_start > covered or fields[1][3:4] != b"p" or not anonymous:
                return False
            covered = v_end
    return covered >= end


def open_uffd() -> UffdPages | None:
    """A :class:`UffdPages` for this process, or ``None`` if the kernel or its settings
    refuse write-protect userfaultfd with asynchronous faults and ``PAGEMAP_SCAN``."""
    number = _SYSCALL.get(platform.machine())
    if number is None:
        log.info("userfaultfd page tracking: unknown syscall number on %s", platform.machine())
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    uffd = -1
    for flags in (os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY, os.O_CLOEXEC | os.O_NONBLOCK):
        uffd = libc.syscall(ctypes.c_long(number), ctypes.c_int(flags))
        if uffd >= 0 or ctypes.get_errno() != errno.EINVAL:
            break  # EINVAL: a kernel before UFFD_USER_MODE_ONLY; retry without it
    if uffd < 0:
        log.info("userfaultfd unavailable: %s", os.strerror(ctypes.get_errno()))
        return None
    try:
        api = _Api(_UFFD_API, _FEATURES, 0)
        _ioctl(uffd, _UFFDIO_API, api)
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        os.close(uffd)
        log.info("userfaultfd write tracking unavailable: %s", exc)
        return None
    if api.features & _FEATURES != _FEATURES:
        os.close(uffd)
        os.close(pagemap)
        log.info("userfaultfd lacks asynchronous write-protect faults; large buffers are hashed")
        return None
    pages = UffdPages(uffd, pagemap)
    if not _works(pages):
        log.info("userfaultfd write tracking fails its self-test; large buffers are hashed")
        os.close(uffd)
        os.close(pagemap)
        return None
    return pages


def _works(pages: UffdPages) -> bool:
    """Arm a private page, write it, and check the write is seen exactly once."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        cell = ctypes.c_char.from_buffer(region)
        address = ctypes.addressof(cell)
        del cell
        armed = pages.track(address, page, weakref.ref(region))
        pages.clear()
        clean = not pages.written(address, page)
        region[0] = 1
        seen = pages.written(address, page)
        pages.clear()
        return armed and clean and seen and not pages.written(address, page)
    except OSError as exc:
        log.info("userfaultfd self-test: %s", exc)
        return False
    finally:
        region.close()  # its span is pruned once the mmap object is gone
