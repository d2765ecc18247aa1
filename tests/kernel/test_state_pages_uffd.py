"""The userfaultfd page-write tracker: every way a program writes a buffer is seen.

A missed write lets replicas diverge silently, so each test arms a buffer the way
``BufferKeys`` does (track, read, clear), writes it one way, and checks the write
shows. ``BufferKeys`` judges a buffer's partial first and last page by the bytes it
hashed, not by their page bits: the last tests check that through it.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import mmap
import os
import pickle
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbos.kernel.state import _pages
from nbos.kernel.state._buffers import BufferKeys, place_of
from nbos.kernel.state._uffd import UffdPages, open_uffd
from tests.kernel.conftest import Pair

PAGE = mmap.PAGESIZE
N = 300_000  # float64s: 2.4 MB, neither page-aligned nor a whole number of pages

_opened: list[UffdPages | None] = []


def process_tracker() -> UffdPages | None:
    """The process's tracker if it is the userfaultfd one, else one opened once here
    (a second userfaultfd could not register memory the first one still holds)."""
    probed = _pages.probe()
    if isinstance(probed, UffdPages):
        return probed
    if not _opened:
        _opened.append(open_uffd())
    return _opened[0]


@pytest.fixture
def pages() -> UffdPages:
    tracker = process_tracker()
    if tracker is None:
        pytest.skip("this kernel or its settings refuse write-protect userfaultfd")
    return tracker


Place = tuple[int, int]


def whole_pages(place: Place) -> Place:
    """The pages wholly inside a range: its others may hold data that others write
    (``BufferKeys`` judges those by their bytes)."""
    address, nbytes = place
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    return start, end - start


def arm(pages: UffdPages, address: int, nbytes: int, owner: object) -> Place:
    """Track a range as a capture does, start a fresh interval, and check it reads clean."""
    assert pages.track(address, nbytes, weakref.ref(owner))
    pages.clear()
    assert not pages.written(*whole_pages((address, nbytes)))
    return address, nbytes


def arm_array(pages: UffdPages, array: np.ndarray) -> Place:
    return arm(pages, array.ctypes.data, array.nbytes, array)


def in_thread(action: Callable[[], object]) -> None:
    worker = threading.Thread(target=action)
    worker.start()
    worker.join()


def through_pipe(view: memoryview) -> None:
    """The kernel writes the buffer (``readv``), not user code."""
    read, write = os.pipe()
    try:
        os.write(write, b"\x07" * len(view))
        os.readv(read, [view])
    finally:
        os.close(read)
        os.close(write)


def bytes_of(array: np.ndarray) -> memoryview:
    exporter: Any = array  # numpy's stubs do not declare the buffer protocol
    return memoryview(exporter).cast("B")


WRITES: dict[str, Callable[[np.ndarray], object]] = {
    "numpy item": lambda a: a.__setitem__(N // 2, 2.0),
    "first element": lambda a: a.__setitem__(0, 2.0),
    "last element": lambda a: a.__setitem__(-1, 2.0),
    "memoryview": lambda a: bytes_of(a).__setitem__(12345, 9),
    "ctypes memmove": lambda a: ctypes.memmove(a.ctypes.data + 4096 * 100, b"abcdefgh", 8),
    "another thread": lambda a: in_thread(lambda: a.__setitem__(7, 3.0)),
    "np.copyto": lambda a: np.copyto(a, np.full_like(a, 5.0)),
    "in-place ufunc": lambda a: np.add(a, 1, out=a),
    "readv by the kernel": lambda a: through_pipe(bytes_of(a)[8000:8016]),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_every_kind_of_write_to_an_array_is_seen(
    pages: UffdPages, write: Callable[[np.ndarray], object]
) -> None:
    array = np.zeros(N)
    place = arm_array(pages, array)
    write(array)
    assert pages.written(*place)
    arm_array(pages, array)  # read again, as the next capture does: clean from there on


def test_the_scan_reports_writes_to_watchers_before_it_rearms(pages: UffdPages) -> None:
    array = np.zeros(N)
    place = arm_array(pages, array)
    seen: list[bool] = []

    class Watcher:
        def before_clear(self, tracker: _pages.PageWrites) -> None:
            seen.append(tracker.written(*whole_pages(place)))

    watcher = Watcher()
    pages.watch(watcher)
    array[N // 2] = 1.0
    pages.clear()
    pages.clear()
    assert seen == [True, False]


TORCH_WRITES: dict[str, Callable[[Any], object]] = {
    "t.numpy() item": lambda t: t.numpy().__setitem__(10, 4.0),
    "t.data.add_()": lambda t: t.data.add_(1),
    "t.add_()": lambda t: t.add_(1),
    "a view's fill_()": lambda t: t[1000:1001].fill_(2.0),
}


@pytest.mark.parametrize("write", TORCH_WRITES.values(), ids=TORCH_WRITES.keys())
def test_every_kind_of_write_to_a_tensor_is_seen(
    pages: UffdPages, write: Callable[[Any], object]
) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(N, dtype=torch.float64)
    place = arm(pages, tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor)
    write(tensor)
    assert pages.written(*place)


def test_a_write_between_arming_and_the_next_clear_is_reported(pages: UffdPages) -> None:
    array = np.zeros(N)
    place = (array.ctypes.data, array.nbytes)
    seen: list[bool] = []

    class Watcher:
        def before_clear(self, tracker: _pages.PageWrites) -> None:
            seen.append(tracker.written(*place))

    watcher = Watcher()
    pages.watch(watcher)
    assert pages.track(*place, weakref.ref(array))
    array[N // 2] = 1.0  # while the capture reads it: the hash may have missed it
    array[N // 2] = 0.0  # even undone before the read ends
    pages.clear()
    assert seen[-1] is True


def test_ranges_not_armed_count_as_written(pages: UffdPages) -> None:
    array = np.zeros(N)
    assert pages.written(array.ctypes.data, array.nbytes)
    shared = mmap.mmap(-1, 4 * PAGE)  # MAP_SHARED: other mappings could write it unseen
    address = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    assert not pages.track(address, 4 * PAGE, weakref.ref(shared))
    assert pages.written(address, 4 * PAGE)


def test_a_file_mapping_is_not_tracked(pages: UffdPages, tmp_path: Path) -> None:
    mapped = np.memmap(tmp_path / "data", dtype=np.float64, mode="w+", shape=(N,))
    assert not pages.track(mapped.ctypes.data, mapped.nbytes, weakref.ref(mapped))
    assert pages.written(mapped.ctypes.data, mapped.nbytes)


def test_a_range_whose_owner_died_counts_as_written(pages: UffdPages) -> None:
    array = np.zeros(N)
    place = arm_array(pages, array)
    del array
    gc.collect()
    reused = np.zeros(N)  # often at the same address
    assert pages.written(*place)
    place = arm_array(pages, reused)
    reused[5] = 1.0
    assert pages.written(*place)


def test_unmapped_and_mapped_again_counts_as_written(pages: UffdPages) -> None:
    region = mmap.mmap(-1, 16 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    place = arm(pages, address, 16 * PAGE, region)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    fixed = 0x10 | mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # MAP_FIXED: fresh zero pages in place
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    assert libc.mmap(address, 16 * PAGE, prot, fixed, -1, 0) == address
    assert pages.written(*place)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_neither_trusts_nor_rearms_the_parents_pages(pages: UffdPages) -> None:
    array = np.zeros(N)
    place = arm_array(pages, array)
    array[N // 3] = 1.0  # written before the fork: the parent must still see it
    pid = os.fork()
    if pid == 0:  # the child: every range counts as written; its clear touches nothing
        code = 0 if pages.written(*place) and not pages.track(*place, weakref.ref(array)) else 1
        pages.clear()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pages.written(*place)
    pages.clear()
    assert not pages.written(*whole_pages(place))
    array[N // 2] = 1.0  # a write to a page the fork made copy-on-write
    assert pages.written(*whole_pages(place))


@pytest.mark.anyio
async def test_a_capture_hashes_an_untouched_tensor_no_more(pair: Pair) -> None:
    pytest.importorskip("torch")
    if not isinstance(_pages.probe(), UffdPages):
        pytest.skip("the process tracks page writes another way, or not at all")
    await pair.cell("import torch\nt = torch.zeros(300_000, dtype=torch.float64)")
    await pair.cell("x = 1")
    assert pair.capture.hashed_bytes == 0
    delta = await pair.cell("t.data.add_(1)")  # bumps no version counter: the pages tell
    assert pair.capture.hashed_bytes > 0 and delta.blobs
    assert float(pair.replica["t"].sum()) == 300_000.0


def buffer_of(array: np.ndarray) -> pickle.PickleBuffer:
    exporter: Any = array
    return pickle.PickleBuffer(exporter)


def key_of(data: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(data.tobytes()).hexdigest()


@pytest.mark.anyio
async def test_buffer_keys_judge_shared_pages_by_the_bytes_hashed(pages: UffdPages) -> None:
    backing = np.zeros(64 * PAGE, dtype=np.uint8)
    inner = backing[100 : 100 + 60 * PAGE]  # shares its first and last page with backing
    keys = BufferKeys(pages)
    place = place_of(buffer_of(inner))

    async def key_now() -> str:
        found = await keys.keys([buffer_of(inner)], {id(inner): backing})
        return found[place]

    first = await key_now()
    backing[99] = 1  # neighbours on the shared pages: no rehash
    backing[100 + 60 * PAGE] = 1
    assert await key_now() == first and keys.hashed_bytes == 0
    for index in (0, 30 * PAGE, inner.nbytes - 1):  # first page, a whole page, last page
        inner[index] = 7
        assert await key_now() == key_of(inner) != first and keys.hashed_bytes == inner.nbytes
        inner[index] = 0
        assert await key_now() == first
        assert await key_now() == first and keys.hashed_bytes == 0


UNPRIVILEGED_PROBE = """
import json, os, weakref
import numpy as np
from nbos.kernel.state._uffd import open_uffd
pages = open_uffd()
seen = None
if pages is not None:
    array = np.zeros(300_000)
    place = (array.ctypes.data, array.nbytes)
    pages.track(*place, weakref.ref(array))
    pages.clear()
    clean = not pages.written(array.ctypes.data + 8192, 8192)
    read, write = os.pipe()
    os.write(write, b"x" * 16)
    os.readv(read, [memoryview(array).cast("B")[8192:8208]])  # a kernel-mode write
    seen = clean and pages.written(array.ctypes.data + 8192, 8192)
print(json.dumps({"uid": os.getuid(), "tracker": pages is not None, "seen": seen}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(), reason="needs root")
def test_an_unprivileged_process_tracks_writes_or_falls_back_cleanly(pages: UffdPages) -> None:
    # vm.unprivileged_userfaultfd=0 refuses plain userfaultfds to such a process;
    # UFFD_USER_MODE_ONLY ones are allowed, and kernel-mode writes are still seen.
    nobody = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run(
        [*nobody, sys.executable, "-c", UNPRIVILEGED_PROBE],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == 65534
    assert report["seen"] is (True if report["tracker"] else None)
