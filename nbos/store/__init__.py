"""Object stores: where large values of kernel namespaces live, as content-addressed blobs.

``open_store(settings)`` opens the configured one. Implementations: ``LocalObjectStore``
(a local directory, the embedded default) and ``RedisObjectStore`` (one Redis server;
needs the ``redis`` extra, so it is imported only when first used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbos.core.object_store import StoreFactory
from nbos.store._factory import ENTRY_POINT_GROUP, open_store
from nbos.store.local import LocalObjectStore

if TYPE_CHECKING:
    from nbos.store.redis import RedisObjectStore

__all__ = [
    "ENTRY_POINT_GROUP",
    "LocalObjectStore",
    "RedisObjectStore",
    "StoreFactory",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "RedisObjectStore":
        from nbos.store.redis import RedisObjectStore

        return RedisObjectStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
