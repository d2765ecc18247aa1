"""Whole-namespace images for Raft snapshots, and applying bad entries."""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import pytest

from nbos.core.errors import BlobNotFoundError, KernelError
from nbos.core.ids import BlobKey
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import apply, dump_namespace, load_namespace, namespace_digest
from nbos.store.local import LocalObjectStore
from tests.kernel.conftest import Pair, fresh_namespace

pytestmark = pytest.mark.anyio


async def test_dump_and_load_a_namespace(pair: Pair) -> None:
    await pair.cell(
        """
        import numpy as np
        import os
        class P:
            def __init__(self, v): self.v = v
        def mk(v): return P(v)
        a = [mk(1), mk(2)]
        b = a[0]
        big = np.ones(300_000)
        lock = __import__('threading').Lock()
        """
    )
    image = await dump_namespace(pair.executor, pair.store)
    loaded: dict[str, Any] = await load_namespace(image, pair.store)
    assert namespace_digest(loaded) == namespace_digest(pair.executor)
    assert "lock" not in loaded and loaded["os"] is __import__("os")
    assert loaded["b"] is loaded["a"][0] and isinstance(loaded["b"], loaded["P"])
    assert loaded["mk"](3).v == 3 and loaded["mk"].__globals__ is loaded
    assert len(image) < 1 << 16  # the array's bytes are a blob, not in the image


async def test_a_replica_started_from_a_snapshot_then_follows_deltas(pair: Pair) -> None:
    await pair.cell("x = [1]\ny = x")
    image = await dump_namespace(pair.executor, pair.store)
    late = await load_namespace(image, pair.store)
    late.update({k: v for k, v in fresh_namespace().items() if k not in late})
    delta = await pair.cell("x.append(2)\nz = 3")
    await apply(late, delta, pair.store)
    assert namespace_digest(late) == namespace_digest(pair.executor)
    assert late["y"] is late["x"]


async def test_a_bad_image_is_a_kernel_error(store: LocalObjectStore) -> None:
    with pytest.raises(KernelError):
        await load_namespace(b"\x93not an image", store)


async def test_a_module_that_does_not_import_leaves_the_namespace_untouched(
    store: LocalObjectStore,
) -> None:
    namespace = {"keep": 1}
    delta = StateDelta(exec_index=4, deleted=["keep"], imports=[("m", "no_such_module_xyz")])
    with pytest.raises(KernelError, match="no_such_module_xyz"):
        await apply(namespace, delta, store)
    assert namespace == {"keep": 1}


async def test_a_corrupt_pickle_is_a_kernel_error(store: LocalObjectStore) -> None:
    namespace = {"keep": 1}
    for data in (b"\x80\x05garbage", pickle.dumps([1, 2])):
        with pytest.raises(KernelError):
            await apply(namespace, StateDelta(exec_index=1, set=data, deleted=["keep"]), store)
    assert namespace == {"keep": 1}


async def test_a_missing_blob_is_a_store_error(store: LocalObjectStore) -> None:
    data = pickle.dumps({"a": 1}, protocol=5)
    delta = StateDelta(exec_index=1, set=data, blobs=[BlobKey("sha256:" + "0" * 64)])
    with pytest.raises(BlobNotFoundError):
        await apply({}, delta, store)
    with pytest.raises(KernelError):
        bad_key = StateDelta(exec_index=1, set=data, blobs=[BlobKey("../../etc/passwd")])
        await apply({}, bad_key, store)


def test_state_delta_is_strict() -> None:
    from nbos.core.errors import DecodeError
    from nbos.core.wire import decode, encode

    good = encode(StateDelta(exec_index=1))
    assert decode(good) == StateDelta(exec_index=1)
    bad = msgspec.msgpack.encode([1, {"t": "StateDelta", "exec_index": "one"}])
    with pytest.raises(DecodeError):
        decode(bad)
