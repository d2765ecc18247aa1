"""The unchanged-buffer logic of ``BufferKeys``, driven by recorded page writes.

Where the kernel keeps soft-dirty bits, ``test_state_blobs`` checks the real thing;
this machine's kernel may not, so here a recorder stands in for the page bits: the
test tells it which memory it wrote, exactly what the kernel would have recorded.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from nbos.kernel.state._buffers import BufferKeys, place_of
from nbos.kernel.state._page_writes import Watcher
from nbos.kernel.state._uffd import merged

pytestmark = pytest.mark.anyio

PAGE = mmap.PAGESIZE


class RecordedWrites:
    """Page bits as the kernel keeps them, fed by the test's account of its own writes."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int]] = []
        self.calls: list[str] = []
        self.watchers: list[Watcher] = []
        self.armed: list[tuple[str, int, int]] = []

    def wrote(self, array: np.ndarray) -> None:
        self.writes.append((array.ctypes.data, array.nbytes))

    def watch(self, watcher: Watcher) -> None:
        self.watchers.append(watcher)

    def clear(self) -> None:
        for watcher in self.watchers:
            watcher.before_clear(self)
        self.calls.append("clear")
        self.writes.clear()

    def track(self, address: int, nbytes: int, owner: Callable[[], object]) -> bool:
        self.armed.append(("track", address, nbytes))
        return True

    def written(self, address: int, nbytes: int) -> bool:
        self.calls.append("read")
        return any(a < address + nbytes and address < a + n for a, n in self.writes)

    def written_spans(self, address: int, nbytes: int) -> list[tuple[int, int]]:
        """The pages the writes touched, clipped to the range, as the kernel reports them."""
        pages = [(a // PAGE * PAGE, -(-(a + n) // PAGE) * PAGE) for a, n in self.writes]
        return merged(pages, address, address + nbytes)


def buffer_of(array: np.ndarray) -> pickle.PickleBuffer:
    exporter: Any = array  # numpy's stubs do not declare the buffer protocol
    return pickle.PickleBuffer(exporter)


def key_of(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(array.tobytes()).hexdigest()


async def test_unwritten_buffers_are_not_hashed_again() -> None:
    pages = RecordedWrites()
    keys = BufferKeys(pages)
    a, b = np.ones(1 << 16), np.zeros(1 << 16)
    first = await keys.keys([buffer_of(a), buffer_of(b)], {})
    assert keys.hashed_bytes == a.nbytes + b.nbytes
    assert first[place_of(buffer_of(a))] == key_of(a)

    second = await keys.keys([buffer_of(a), buffer_of(b)], {})
    assert keys.hashed_bytes == 0 and second == first

    a[100] = 5.0
    pages.wrote(a[100:101])
    third = await keys.keys([buffer_of(a), buffer_of(b)], {})
    assert keys.hashed_bytes == a.nbytes
    assert third[place_of(buffer_of(a))] == key_of(a) != first[place_of(buffer_of(a))]
    # every read of the bits precedes the clear that starts the next interval
    assert pages.calls[-3:] == ["read", "read", "clear"]
    # each hashed buffer was armed for tracking: a, b, then a again
    places = [("track", x.ctypes.data, x.nbytes) for x in (a, b, a)]
    assert pages.armed == places


class Owner:
    """Stands for an object that owns a temporary exporter's memory (a tensor)."""


async def test_the_owner_not_the_temporary_exporter_keeps_an_entry_valid() -> None:
    keys = BufferKeys(RecordedWrites())
    data = np.ones(1 << 16)
    owner = Owner()
    await keys.keys([buffer_of(data[:])], {})
    gc.collect()  # the temporary view may sit in a reference cycle until then
    await keys.keys([buffer_of(data[:])], {})
    # an exporter that dies after each capture, with no owner named: never trusted
    assert keys.hashed_bytes == data.nbytes

    view = data[:]
    await keys.keys([buffer_of(view)], {id(view): owner})
    view = data[:]
    await keys.keys([buffer_of(view)], {id(view): owner})
    assert keys.hashed_bytes == 0
    del owner
    gc.collect()
    await keys.keys([buffer_of(view)], {})
    assert keys.hashed_bytes == data.nbytes


async def test_buffers_that_left_are_forgotten_and_not_kept_alive() -> None:
    keys = BufferKeys(RecordedWrites())
    gone = np.ones(1 << 16)
    ref = weakref.ref(gone)
    await keys.keys([buffer_of(gone)], {})
    await keys.keys([], {})
    del gone
    gc.collect()
    assert ref() is None


async def test_without_page_bits_everything_is_hashed() -> None:
    keys = BufferKeys(None)
    a = np.ones(1 << 16)
    await keys.keys([buffer_of(a)], {})
    await keys.keys([buffer_of(a)], {})
    assert keys.hashed_bytes == a.nbytes


async def test_a_clear_by_another_capture_loses_no_write() -> None:
    pages = RecordedWrites()
    mine, other = BufferKeys(pages), BufferKeys(pages)
    a = np.ones(1 << 16)
    await mine.keys([buffer_of(a)], {})
    a[0] = 7.0
    pages.wrote(a[:1])
    await other.keys([], {})  # clears the bits mine relied on
    found = await mine.keys([buffer_of(a)], {})
    assert mine.hashed_bytes == a.nbytes and found[place_of(buffer_of(a))] == key_of(a)


def test_the_process_page_bits_are_probed_once() -> None:
    from nbos.kernel.state._pages import probe

    assert probe() is probe()


async def test_without_page_bits_chunk_digests_tell_changes_in_any_chunk() -> None:
    keys = BufferKeys(None)
    a = np.zeros(20 << 17)  # 20 MiB: three 8 MiB chunks
    first = (await keys.keys([buffer_of(a)], {}))[place_of(buffer_of(a))]
    for index in (0, a.size // 2, a.size - 1):
        a[index] = 1.0
        changed = (await keys.keys([buffer_of(a)], {}))[place_of(buffer_of(a))]
        assert changed == key_of(a) != first
        a[index] = 0.0
        assert (await keys.keys([buffer_of(a)], {}))[place_of(buffer_of(a))] == first
