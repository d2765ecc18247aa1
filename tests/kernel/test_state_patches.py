"""A large buffer written on a few pages is stored as a patch of those pages.

These need a page-write tracker (soft-dirty bits or write-protect userfaultfd); without
one every written buffer is hashed and stored whole, which ``test_state_blobs`` covers.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import weakref

import msgspec
import numpy as np
import pytest

from nbos.core.errors import BlobNotFoundError, KernelError, StoreError
from nbos.core.ids import BlobKey
from nbos.kernel.state import StateCapture, _codec, _pages, _patch, apply, load_namespace
from nbos.kernel.state._buffers import fetch
from nbos.kernel.state._page_writes import PageWrites, Span
from nbos.store.local import LocalObjectStore
from tests.kernel.conftest import Pair

pytestmark = pytest.mark.anyio

PAGE = mmap.PAGESIZE
MIB = 1 << 20
N = 32 * MIB // 8  # float64 elements in a 32 MiB array


@pytest.fixture(autouse=True)
def tracker() -> PageWrites:
    pages = _pages.probe()
    if pages is None:
        pytest.skip("this kernel keeps no soft-dirty bits and refuses userfaultfd tracking")
    return pages


def store_bytes(store: LocalObjectStore) -> int:
    return sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file())


def key_of(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(array.tobytes()).hexdigest()


async def replica_rebuilds_from_the_store_alone(pair: Pair, name: str) -> None:
    """A fresh namespace given only the last delta holds the executor's array (the
    replica's copies are dropped first: none of them is held to build on)."""
    pair.replica.clear()
    gc.collect()
    last = pair.deltas[-1]
    encoded = _codec.Encoded(last.set, last.set_blob, last.blobs)
    values = await _codec.decode(encoded, {}, pair.store)
    assert np.array_equal(values[name], pair.executor[name])


async def test_one_element_written_adds_about_a_page_to_the_store(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    assert first.blobs == [key_of(pair.executor["big"])]
    before = store_bytes(pair.store)
    delta = await pair.cell(f"big[{N // 2}] = 7.0")
    # the written page (and any partial end page written), and a small header
    assert store_bytes(pair.store) - before <= 3 * PAGE + 512
    assert _patch.is_patch(delta.blobs[0])
    assert pair.capture.hashed_bytes <= 3 * PAGE
    assert pair.replica["big"][N // 2] == 7.0 and pair.replica["big"].flags.writeable
    await replica_rebuilds_from_the_store_alone(pair, "big")


async def test_a_chain_of_patches_ends_in_a_whole_blob_after_max_depth(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_patch, "MAX_DEPTH", 8)  # the rule, not the constant: cells stay few
    n = 4 * MIB // 8
    await pair.cell(f"import numpy as np\nbig = np.zeros({n})")
    refs = []
    for i in range(_patch.MAX_DEPTH + 2):
        delta = await pair.cell(f"big[{i * PAGE // 8}] = {i + 1}.0")
        refs.append(delta.blobs[0])
        if i == _patch.MAX_DEPTH:
            assert refs[-1] == key_of(pair.executor["big"])  # stored whole again
    assert all(_patch.is_patch(ref) for ref in refs[: _patch.MAX_DEPTH])
    assert _patch.is_patch(refs[_patch.MAX_DEPTH + 1])  # and patched from there
    await replica_rebuilds_from_the_store_alone(pair, "big")


async def test_patches_since_the_whole_version_hold_at_most_max_share(pair: Pair) -> None:
    n = 4 * MIB // 8
    # A fortieth of the buffer a cell: 26 or 27 pages, so 4 patches hold less than an
    # eighth of it and 5 more, wherever the array lies against page boundaries.
    share = n // 40
    await pair.cell(f"import numpy as np\nbig = np.zeros({n})")
    refs = []
    for i in range(6):
        delta = await pair.cell(f"big[{i * share} : {(i + 1) * share}] = 1.0")
        refs.append(delta.blobs[0])
        if i == 4:
            assert refs[-1] == key_of(pair.executor["big"])
    assert [_patch.is_patch(ref) for ref in refs] == [True] * 4 + [False, True]
    await replica_rebuilds_from_the_store_alone(pair, "big")


async def test_a_buffer_written_on_many_pages_is_stored_whole(pair: Pair) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    delta = await pair.cell(f"big[: {N // 4}] = 1.0")
    assert delta.blobs == [key_of(pair.executor["big"])]


async def test_writes_through_a_view_are_patched_into_the_base_array(pair: Pair) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})\nview = big[1000:]")
    delta = await pair.cell("view[5] = 3.0\nbig[-1] = 4.0")
    assert delta.blobs and all(_patch.is_patch(ref) for ref in delta.blobs)
    replica = pair.replica
    assert replica["big"][1005] == 3.0 and replica["big"][-1] == 4.0
    assert np.shares_memory(replica["view"], replica["big"])


async def test_a_replica_builds_a_patch_on_the_copy_it_holds(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    await pair.store.delete(first.blobs[0])  # only the replica's own copy has it now
    delta = await pair.cell("big[7] = 1.0")
    assert _patch.is_patch(delta.blobs[0]) and pair.replica["big"][7] == 1.0


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


async def test_a_patch_is_written_over_a_buffer_only_the_replaced_value_reaches(
    pair: Pair,
) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    await pair.store.delete(first.blobs[0])  # the replica may only build on what it holds
    where = address_of(pair.replica["big"])
    for i in range(3):  # and it still holds the patched version, unwritten, for the next
        delta = await pair.cell(f"big[{7 + i}] = {i + 1}.0")
        assert delta.set_names == ["big"] and _patch.is_patch(delta.blobs[0])
        assert address_of(pair.replica["big"]) == where
    assert list(pair.replica["big"][7:10]) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("holder", ["the old array", "a view", "a list"])
async def test_a_buffer_that_anything_else_reaches_is_copied_before_it_is_patched(
    pair: Pair, holder: str
) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    old = pair.replica["big"]
    held = {"the old array": old, "a view": old[:10], "a list": [old]}[holder]
    del old
    await pair.cell("big[7] = 1.0")
    kept = held[0] if isinstance(held, list) else held
    assert kept[7] == 0.0  # still the bytes it had
    assert not np.shares_memory(pair.replica["big"], kept)


async def test_a_failed_apply_puts_back_what_it_patched_in_place(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    await pair.store.delete(first.blobs[0])
    where = address_of(pair.replica["big"])
    exec(f"big[7] = 1.0\nlater = np.full({N}, 3.0)", pair.executor)
    delta = await pair.capture.capture(pair.executor, exec_index=2)
    assert _patch.is_patch(delta.blobs[0]) and len(delta.blobs) == 2
    await pair.store.delete(BlobKey(delta.blobs[1]))  # fails after big's patch is written
    with pytest.raises(BlobNotFoundError):
        await apply(pair.replica, delta, pair.store)
    assert address_of(pair.replica["big"]) == where and not pair.replica["big"].any()
    assert "later" not in pair.replica


async def test_an_entry_whose_names_disagree_with_its_pickle_is_refused_intact(
    pair: Pair,
) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    exec("moved = big\ndel big\nmoved[7] = 1.0", pair.executor)
    delta = await pair.capture.capture(pair.executor, exec_index=2)
    assert delta.set_names == ["moved"] and delta.deleted == ["big"]
    forged = msgspec.structs.replace(delta, set_names=["big", "moved"])
    with pytest.raises(KernelError, match="lacks"):
        await apply(pair.replica, forged, pair.store)
    assert not pair.replica["big"].any() and "moved" not in pair.replica
    await apply(pair.replica, delta, pair.store)
    assert pair.replica["moved"][7] == 1.0 and "big" not in pair.replica


@pytest.mark.parametrize("written", ["before the capture's clear", "after it"])
async def test_a_held_copy_written_to_is_not_built_on(pair: Pair, written: str) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    await pair.store.delete(first.blobs[0])
    if written.startswith("before"):
        pair.replica["big"][100] = 5.0  # as a cell run on this replica after a failover would
    pair.executor["big"][7] = 1.0
    delta = await pair.capture.capture(pair.executor, exec_index=2)
    if not written.startswith("before"):
        pair.replica["big"][100] = 5.0
    with pytest.raises(BlobNotFoundError):
        await apply(pair.replica, delta, pair.store)


async def test_a_held_copy_no_value_uses_is_freed(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    await pair.store.delete(first.blobs[0])
    del pair.replica["big"]
    gc.collect()
    with pytest.raises(BlobNotFoundError):
        await pair.cell("big[7] = 1.0")


async def test_the_tracker_tells_which_pages_were_written(tracker: PageWrites) -> None:
    array = np.zeros(64 * PAGE, dtype=np.uint8)
    address = array.ctypes.data
    start = -(-address // PAGE) * PAGE  # the first whole page
    seen: list[list[Span] | None] = []

    class Reader:
        def before_clear(self, pages: PageWrites) -> None:
            seen.append(pages.written_spans(start, 40 * PAGE))

    reader = Reader()
    tracker.watch(reader)
    assert tracker.track(address, array.nbytes, weakref.ref(array))
    tracker.clear()
    offset = start - address
    array[offset + 3 * PAGE + 10] = 1
    array[offset + 4 * PAGE] = 1  # touches the page after: one span of two pages
    array[offset + 20 * PAGE + 1] = 1
    array[offset + 50 * PAGE] = 1  # outside the range asked about
    tracker.clear()
    expected = [
        (start + 3 * PAGE, start + 5 * PAGE),
        (start + 20 * PAGE, start + 21 * PAGE),
    ]
    assert seen[-1] == expected


async def stored_patch(
    store: LocalObjectStore, base: str, nbytes: int, ranges: list[tuple[int, int]], body: bytes
) -> BlobKey:
    parts = _patch.parts(base, nbytes, ranges, [body])
    return _patch.reference(await store.put(b"".join(bytes(p) for p in parts)))


async def test_malformed_patches_are_refused_with_a_store_error(store: LocalObjectStore) -> None:
    base = await store.put(bytes(100))
    good = await stored_patch(store, base, 100, [(10, 2)], b"ab")
    assert (await fetch(store, good))[8:14] == bytearray(b"\0\0ab\0\0")
    bad = [
        _patch.reference(await store.put(b"\xff\xff\xff\xffnot a header")),
        await stored_patch(store, base, 100, [(10, 2)], b"abc"),  # body longer than its ranges
        await stored_patch(store, base, 100, [(99, 2)], b"ab"),  # past the end
        await stored_patch(store, base, 100, [(10, 2), (11, 2)], b"abcd"),  # overlapping
        await stored_patch(store, base, 50, [(10, 2)], b"ab"),  # not the base's size
        await stored_patch(store, "md5:00", 100, [(10, 2)], b"ab"),  # no buffer reference
    ]
    for ref in bad:
        with pytest.raises(StoreError):
            await fetch(store, ref)


async def test_a_chain_longer_than_max_depth_is_refused(store: LocalObjectStore) -> None:
    ref: str = await store.put(bytes(1000))
    for i in range(_patch.MAX_DEPTH + 1):
        ref = await stored_patch(store, ref, 1000, [(i, 1)], b"x")
    with pytest.raises(StoreError, match="more than"):
        await fetch(store, BlobKey(ref))


async def test_a_snapshot_image_refers_to_buffers_as_the_capture_stored_them(pair: Pair) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    delta = await pair.cell("big[7] = 1.0")
    before = store_bytes(pair.store)
    image = await pair.capture.image(pair.executor)
    assert pair.capture.hashed_bytes == 0 and store_bytes(pair.store) == before
    assert delta.blobs[0].encode() in image  # the patch's reference, not a new whole blob
    restored = await load_namespace(image, pair.store)
    assert np.array_equal(restored["big"], pair.executor["big"])


async def test_a_replica_images_what_it_applied_without_hashing_it(pair: Pair) -> None:
    await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    delta = await pair.cell("big[7] = 1.0")
    own = StateCapture(pair.store)  # the replica's own, which never captured a cell
    before = store_bytes(pair.store)
    image = await own.image(pair.replica)
    assert own.hashed_bytes == 0 and store_bytes(pair.store) == before
    assert delta.blobs[0].encode() in image
    pair.replica["big"][9] = 2.0  # written: no longer the bytes it was read with
    image = await own.image(pair.replica)  # a patch over what it knows now
    assert 0 < own.hashed_bytes <= 3 * PAGE
    assert (await load_namespace(image, pair.store))["big"][9] == 2.0
    other = StateCapture(pair.store)  # knows nothing: the held copy is written, so it hashes
    await other.image(pair.replica)
    assert other.hashed_bytes == N * 8
