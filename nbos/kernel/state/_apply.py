"""Applying a captured delta to a replica's namespace."""

from __future__ import annotations

import importlib
import logging
from collections.abc import MutableMapping
from typing import Any

from nbos.core.errors import KernelError
from nbos.core.object_store import ObjectStore
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import _codec

log = logging.getLogger(__name__)


async def apply(namespace: MutableMapping[str, Any], delta: StateDelta, store: ObjectStore) -> None:
    """Make ``namespace`` hold what the executor's namespace held after ``delta``'s cell.

    All or nothing: modules are imported and values unpickled before ``namespace``
    changes, so a failure (:class:`~nbos.core.errors.KernelError` for a module
    that does not import here or a pickle that does not load,
    :class:`~nbos.core.errors.StoreError` for a missing blob) leaves it untouched.
    Names the executor could not pickle are removed: a stale copy would differ.
    """
    modules = {alias: import_module(module, delta.exec_index) for alias, module in delta.imports}
    values: dict[str, object] = {}
    if delta.set or delta.set_blob is not None:
        encoded = _codec.Encoded(delta.set, delta.set_blob, delta.blobs)
        try:
            values = await _codec.decode(encoded, namespace, store, replacing=delta.set_names)
        except KernelError:
            log.exception("cannot apply the state of cell %d", delta.exec_index)
            raise
    for name in delta.deleted:
        namespace.pop(name, None)
    for name, _reason in delta.unpicklable:
        namespace.pop(name, None)
    namespace.update(modules)
    namespace.update(values)


def import_module(module: str, exec_index: int) -> object:
    """Import ``module`` for cell ``exec_index``'s state; :class:`KernelError` if it fails."""
    try:
        return importlib.import_module(module)
    except Exception as exc:
        log.error("cell %d imported %s, which fails here: %r", exec_index, module, exc)  # noqa: TRY400
        message = f"cell {exec_index} imported {module!r}, which fails here: {exc}"
        raise KernelError(message) from exc
