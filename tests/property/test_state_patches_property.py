"""Property: whatever elements of a large array cells write, in whatever order, a
replica that applies each capture (patches and whole blobs alike) holds the executor's
array (building on the copy it holds where it can), and a fresh one rebuilds it from the
store and the last capture alone."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbos.kernel.state import StateCapture, _codec, _pages, apply
from nbos.store.local import LocalObjectStore

EXAMPLES = int(os.environ.get("NBOS_PATCH_EXAMPLES", "15"))
N = (4 << 20) // 8  # float64 elements in a 4 MiB array: 1024 pages

pytestmark = pytest.mark.skipif(
    _pages.probe() is None, reason="no page-write tracker on this kernel: nothing is patched"
)

writes = st.lists(st.integers(0, N - 1), min_size=1, max_size=6)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(writes, min_size=1, max_size=24))
def test_any_sequence_of_writes_leaves_replicas_equal(cells: list[list[int]]) -> None:
    anyio.run(_check, cells)


async def _check(cells: list[list[int]]) -> None:
    with tempfile.TemporaryDirectory(prefix="nbos-patches-") as tmp:
        store = LocalObjectStore(Path(tmp))
        try:
            capture = StateCapture(store)
            executor: dict[str, object] = {"big": np.zeros(N)}
            replica: dict[str, object] = {}
            for n, elements in enumerate([[], *cells]):
                big = executor["big"]
                assert isinstance(big, np.ndarray)
                for element in elements:
                    big[element] += n
                delta = await capture.capture(executor, exec_index=n + 1)
                await apply(replica, delta, store)
                assert np.array_equal(replica["big"], big)
            replica.clear()  # nothing held: the last delta and the store alone rebuild it
            gc.collect()
            encoded = _codec.Encoded(delta.set, delta.set_blob, delta.blobs)
            fresh = await _codec.decode(encoded, {}, store)
            assert np.array_equal(fresh["big"], executor["big"])
        finally:
            await store.aclose()
