"""Values of 1 MiB or more travel as content-addressed blobs, written once."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from nbos.kernel.state import LARGE, StateCapture
from nbos.kernel.state._pages import probe
from nbos.store.local import LocalObjectStore
from tests.kernel.conftest import Pair, sent_names

pytestmark = pytest.mark.anyio

N = 2 * LARGE // 8  # float64 elements in a 2 MiB array


async def test_large_array_goes_to_the_store_out_of_band(pair: Pair) -> None:
    delta = await pair.cell(f"import numpy as np\nbig = np.arange({N}, dtype=np.float64)")
    assert len(delta.blobs) == 1 and len(delta.set) < 4096
    data = pair.executor["big"].tobytes()
    assert delta.blobs[0] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert await pair.store.get(delta.blobs[0]) == data
    replica_big = pair.replica["big"]
    assert replica_big.flags.writeable and np.array_equal(replica_big, pair.executor["big"])
    replica_big[0] = 1  # a replica's copy is an ordinary array


async def test_small_array_stays_inline(pair: Pair) -> None:
    delta = await pair.cell("import numpy as np\nsmall = np.ones(100)")
    assert delta.blobs == [] and pair.replica["small"].flags.writeable


async def test_unchanged_large_array_is_not_sent_or_written_again(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.ones({N})\nother = 1")
    path = pair.store.path_of(first.blobs[0])
    written = path.stat().st_mtime_ns
    delta = await pair.cell("other = 2")
    assert await sent_names(delta, pair.store) == {"other"} and delta.blobs == []
    delta = await pair.cell("alias = big")  # big's group is sent again: its blob is not rewritten
    assert delta.blobs == first.blobs
    assert path.stat().st_mtime_ns == written
    assert pair.replica["alias"] is pair.replica["big"]


async def test_changed_large_array_gets_a_new_key(pair: Pair) -> None:
    first = await pair.cell(f"import numpy as np\nbig = np.zeros({N})")
    second = await pair.cell(f"big[{N - 1}] = 1.0")
    assert second.blobs and second.blobs != first.blobs
    assert pair.replica["big"][-1] == 1.0


async def test_same_bytes_in_two_arrays_are_one_blob(pair: Pair) -> None:
    delta = await pair.cell(f"import numpy as np\na = np.ones({N})\nb = np.ones({N})")
    assert len(delta.blobs) == 2 and delta.blobs[0] == delta.blobs[1]
    assert pair.replica["a"] is not pair.replica["b"]


async def test_views_and_fortran_order_survive(pair: Pair) -> None:
    await pair.cell(
        f"""
        import numpy as np
        base = np.arange({N}, dtype=np.float64)
        strided = base[::2]
        fortran = np.asfortranarray(base.reshape(512, -1))
        """
    )
    r = pair.replica
    assert np.array_equal(r["strided"], pair.executor["strided"])
    assert r["fortran"].flags.f_contiguous and np.array_equal(
        r["fortran"], pair.executor["fortran"]
    )


async def test_large_pickle_goes_to_a_blob(pair: Pair) -> None:
    delta = await pair.cell("nums = list(range(300_000))")
    assert delta.set == b"" and delta.set_blob is not None
    assert pair.replica["nums"] == list(range(300_000))
    delta = await pair.cell("pass")
    assert delta.set_blob is None and delta.set == b""


async def test_without_page_tracking_every_large_buffer_is_hashed(store: LocalObjectStore) -> None:
    pair = Pair(store, StateCapture(store, page_tracking="off"))
    await pair.cell(f"import numpy as np\nbig = np.ones({N})")
    await pair.cell("x = 1")
    assert pair.capture.hashed_bytes == 8 * N
    delta = await pair.cell("big[5] = 2")  # in place, no rebinding: found by its hash
    assert delta.blobs and pair.replica["big"][5] == 2


@pytest.mark.skipif(probe() is None, reason="this kernel keeps no soft-dirty page bits")
async def test_soft_dirty_bits_spare_hashing_untouched_buffers(pair: Pair) -> None:
    await pair.cell(f"import numpy as np\nbig = np.ones({N})\nview = big[10:]")
    await pair.cell("x = 1")
    assert pair.capture.hashed_bytes == 0
    delta = await pair.cell("view[5] = 3.0")  # written through a view: the pages tell
    assert pair.capture.hashed_bytes > 0 and delta.blobs
    assert pair.replica["big"][15] == 3.0


async def test_large_buffers_without_an_address_are_kept_apart(pair: Pair) -> None:
    # a bytearray exported out of band: not a numpy array, so no address to key it by
    delta = await pair.cell(
        f"""
        import pickle
        class Blob:
            def __init__(self, data):
                self.data = bytearray(data)
            def __reduce_ex__(self, protocol):
                return Blob, (pickle.PickleBuffer(self.data),)
        x = Blob(b"x" * {2 * LARGE})
        y = Blob(b"y" * {2 * LARGE})
        """
    )
    assert len(set(delta.blobs)) == 2
    assert pair.replica["x"].data[:1] == b"x" and pair.replica["y"].data[:1] == b"y"
    delta = await pair.cell("y.data[0] = ord('z')")
    assert pair.replica["y"].data[:2] == b"zy"


async def test_numpy_views_share_memory_with_their_base_on_the_replica(pair: Pair) -> None:
    await pair.cell(
        f"""
        import numpy as np
        base = np.arange({N}, dtype=np.float64)
        head = base[:10]
        backwards = base[::-3]
        grid = base.reshape(-1, 8)[:, 2]
        ro = np.broadcast_to(base[:4], (3, 4))
        unnamed_base = np.arange(12.0)[2:5]
        """
    )
    r = pair.replica
    for name in ("head", "backwards", "grid", "ro"):
        assert np.shares_memory(r[name], r["base"]), name
    assert not r["ro"].flags.writeable and r["head"].flags.writeable
    assert list(r["unnamed_base"]) == [2.0, 3.0, 4.0]
    r["base"][0] = -1.0
    assert r["head"][0] == -1.0  # as it would be on the executor
    delta = await pair.cell("head[1] = 7.0")  # written through the view
    assert pair.replica["base"][1] == 7.0 and len(set(delta.blobs)) == 1
