"""A whole namespace as one image, for Raft snapshots and catching up new replicas."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Mapping, MutableMapping

import msgspec

from nbos.core.errors import KernelError
from nbos.core.object_store import ObjectStore
from nbos.kernel.state import _codec
from nbos.kernel.state._apply import import_module
from nbos.kernel.state._buffers import LARGE, BufferKeys
from nbos.kernel.state._names import user_items

log = logging.getLogger(__name__)


class _Image(msgspec.Struct, forbid_unknown_fields=True):
    values: _codec.Encoded
    imports: list[tuple[str, str]]
    #: Process-wide state (:mod:`._process`) as of the image.
    process: dict[str, bytes | None] = {}


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Image)


async def dump_namespace(
    namespace: Mapping[str, object],
    store: ObjectStore,
    *,
    threshold: int = LARGE,
    process: Mapping[str, bytes | None] | None = None,
    keys: BufferKeys | None = None,
) -> bytes:
    """The user state of ``namespace`` as bytes; large buffers go to ``store``.

    Values that cannot be pickled are left out (and logged), as they are from deltas.
    ``process`` is process-wide state to keep with it (:func:`image_process`). With
    ``keys`` (a capture's), large buffers it knows unchanged are referred to as they
    are stored already rather than hashed and stored again.
    """
    imports: list[tuple[str, str]] = []
    values: dict[str, object] = {}
    for name, value in user_items(namespace):
        if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
            imports.append((name, value.__name__))
        else:
            values[name] = value
    pickled, failed = _codec.pickle_loadable(values, threshold)
    for name, reason in failed.items():
        log.info("snapshot leaves out %s: %s", name, reason)
    found = {} if keys is None else await keys.keys(list(pickled.buffers), pickled.owners, store)
    encoded = await _codec.encode(pickled, store, found, threshold)
    return _encoder.encode(_Image(encoded, imports, dict(process or {})))


async def load_namespace(
    image: bytes, store: ObjectStore, *, globals_of: MutableMapping[str, object] | None = None
) -> dict[str, object]:
    """A fresh namespace holding what :func:`dump_namespace` saved.

    Functions defined in cells get ``globals_of`` as their globals (the namespace the
    values are meant for, which this does not change), or else the fresh namespace.

    Raises :class:`~nbos.core.errors.KernelError` for an image that does not decode.
    """
    decoded = _decode(image)
    namespace: dict[str, object] = {}
    target = namespace if globals_of is None else globals_of
    namespace.update(await _codec.decode(decoded.values, target, store))
    namespace.update({alias: import_module(module, -1) for alias, module in decoded.imports})
    return namespace


def image_process(image: bytes) -> dict[str, bytes | None]:
    """The process-wide state :func:`dump_namespace` kept in ``image``.

    Raises :class:`~nbos.core.errors.KernelError` for an image that does not decode.
    """
    return _decode(image).process


def _decode(image: bytes) -> _Image:
    try:
        return _decoder.decode(image)
    except msgspec.MsgspecError as exc:
        log.error("namespace image does not decode: %s", exc)  # noqa: TRY400
        raise KernelError(f"namespace image does not decode: {exc}") from exc
