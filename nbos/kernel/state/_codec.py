"""Values to (pickle, blob keys) and back: the encoding shared by deltas and snapshots."""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import types
from collections.abc import Collection, MutableMapping, Sequence
from typing import Any

import msgspec

from nbos.core.errors import KernelError
from nbos.core.ids import BLOB_KEY_PREFIX, BlobKey
from nbos.core.object_store import ObjectStore
from nbos.kernel.state import _buffers, _inplace, _patch
from nbos.kernel.state._pickler import NamespacePickler, NamespaceUnpickler, by_value

# Values whose identity no program can rely on: sharing them does not tie two names.
_VALUE_TYPES = (
    str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range, slice,
    types.ModuleType, types.BuiltinFunctionType, types.MethodWrapperType,
)  # fmt: skip


class Pickled(msgspec.Struct):
    """One pickle and what it referenced.

    ``identities`` maps ``id(obj)`` to the object's memo index for every object in
    the pickle whose identity matters (mutable containers, instances, tensors,
    functions and classes pickled by value); ``memo`` keeps those objects alive, so
    ids stay unique while the caller compares pickles.
    """

    data: bytes
    buffers: list[pickle.PickleBuffer]
    owners: dict[int, object]
    identities: dict[int, int]
    memo: dict[int, tuple[int, object]]


def pickle_value(value: object, threshold: int) -> Pickled:
    """Pickle ``value``; buffers of ``threshold`` bytes or more stay out of band."""
    collector = _buffers.BufferCollector(threshold)
    out = io.BytesIO()
    pickler = NamespacePickler(out, collector)
    pickler.dump(value)
    memo: dict[int, tuple[int, object]] = pickler.memo.copy()
    identities = {key: index for key, (index, obj) in memo.items() if _has_identity(obj)}
    return Pickled(out.getvalue(), collector.buffers, pickler.buffer_owners, identities, memo)


def _has_identity(obj: object) -> bool:
    if isinstance(obj, type | types.FunctionType):
        return by_value(obj)  # one imported by name is the same object everywhere
    if isinstance(obj, _VALUE_TYPES):
        return False
    # Arrays of one dtype share a dtype object; that must not tie their names together.
    numpy = sys.modules.get("numpy")
    return numpy is None or not isinstance(obj, numpy.dtype)


class Encoded(msgspec.Struct):
    """A pickle ready for a log entry: inline bytes or a blob key, and its buffers' keys."""

    inline: bytes
    blob: BlobKey | None
    buffers: list[BlobKey]


def pickle_loadable(values: dict[str, object], threshold: int) -> tuple[Pickled, dict[str, str]]:
    """Pickle ``values`` as one pickle, less the values whose pickle does not load back.

    A replica must never be handed an entry it cannot apply, so the pickle is loaded
    here first (out-of-band buffers are read in place, not copied). Returns the pickle
    and, for each value left out, why. Never raises for a value's sake.
    """
    pickled, error = _attempt(values, threshold)
    if pickled is not None:
        return pickled, {}
    failed: dict[str, str] = {}
    for name, value in values.items():
        _, own_error = _attempt({name: value}, threshold)
        if own_error is not None:
            failed[name] = own_error
    rest, _ = _attempt({n: v for n, v in values.items() if n not in failed}, threshold)
    if failed and rest is not None:
        return rest, failed
    # Each loads alone but not together: keep none of them rather than guess.
    return pickle_value({}, threshold), {name: str(error) for name in values}


def _attempt(values: dict[str, object], threshold: int) -> tuple[Pickled | None, str | None]:
    """The pickle of ``values`` if it pickles and loads back, else why not."""
    try:
        pickled = pickle_value(values, threshold)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        _load(pickled.data, {}, [buffer.raw() for buffer in pickled.buffers])
    except Exception as exc:
        return None, f"its pickle does not load back: {type(exc).__name__}: {exc}"
    return pickled, None


async def encode(
    pickled: Pickled,
    store: ObjectStore,
    keys: dict[tuple[int, int], BlobKey],
    threshold: int,
) -> Encoded:
    """Store what is large of ``pickled`` and make it ready for a log entry.

    ``keys`` holds buffer keys the caller already knows by ``(address, nbytes)``;
    those blobs are written only if the store lacks them. Other buffers are streamed
    to the store, which hashes them on the way.
    """
    buffer_keys: list[BlobKey] = []
    for buffer in pickled.buffers:
        view = buffer.raw()
        key = keys.get(_buffers.place_of(buffer))
        if key is None:
            key = await _buffers.store_buffer(store, [view])
        else:
            await _buffers.upload(store, view, key)
        buffer_keys.append(key)
    if len(pickled.data) >= threshold:
        return Encoded(b"", await store.put(pickled.data), buffer_keys)
    return Encoded(pickled.data, None, buffer_keys)


async def decode(
    encoded: Encoded,
    namespace: MutableMapping[str, Any],
    store: ObjectStore,
    *,
    replacing: Collection[str] = (),
) -> dict[str, object]:
    """The values :func:`encode` stored; cell-defined functions get ``namespace`` as globals.

    ``replacing`` names the values of ``namespace`` the caller replaces with these: a
    buffer only they reach may be patched in place (:mod:`._inplace`). On failure its
    bytes are as they were.
    """
    in_place = _inplace.InPlace(namespace, replacing) if replacing else None
    try:
        return await _decode(encoded, namespace, store, in_place)
    except BaseException:
        if in_place is not None:
            in_place.undo()
        raise


async def _decode(
    encoded: Encoded,
    namespace: MutableMapping[str, Any],
    store: ObjectStore,
    in_place: _inplace.InPlace | None,
) -> dict[str, object]:
    data = encoded.inline if encoded.blob is None else await store.get(_checked_key(encoded.blob))
    buffers: list[bytearray | memoryview] = [
        await _buffers.fetch(store, _checked_reference(key), in_place) for key in encoded.buffers
    ]
    try:
        values = _load(data, namespace, buffers)
    except Exception as exc:
        raise KernelError(f"cannot unpickle namespace values: {exc!r}") from exc
    if not isinstance(values, dict):
        raise KernelError(f"namespace pickle holds a {type(values).__name__}, not a dict")
    if in_place is not None and not in_place.relied_on <= values.keys():
        missing = sorted(in_place.relied_on - values.keys())
        raise KernelError(f"namespace pickle lacks {missing}, which its entry names as set")
    return values


def _load(
    data: bytes, namespace: MutableMapping[str, Any], buffers: Sequence[bytearray | memoryview]
) -> Any:
    return NamespaceUnpickler(io.BytesIO(data), namespace, buffers).load()


def _checked_key(key: str) -> BlobKey:
    if not key.startswith(BLOB_KEY_PREFIX):
        raise KernelError(f"bad blob key {key!r} in a state entry")
    return BlobKey(key)


def _checked_reference(ref: str) -> BlobKey:
    if not _patch.is_reference(ref):
        raise KernelError(f"bad buffer reference {ref!r} in a state entry")
    return BlobKey(ref)


def content_hash(pickled: Pickled, keys: list[BlobKey]) -> bytes:
    """A digest of a pickle and its buffers' keys: equal iff the pickled content is."""
    h = hashlib.blake2b(pickled.data, digest_size=16)
    for key in keys:
        h.update(key.encode())
    return h.digest()
