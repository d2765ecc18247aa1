"""Finding backends by name through the ``nbos.backends`` entry point group."""

from __future__ import annotations

from typing import Any

from nbos.core.compute_backend import ComputeBackend
from nbos.core.plugins import PluginGroup

ENTRY_POINT_GROUP = "nbos.backends"

_BACKENDS = PluginGroup[ComputeBackend](ENTRY_POINT_GROUP, ComputeBackend)


def backend_names() -> list[str]:
    """The names registered in the ``nbos.backends`` entry point group, sorted."""
    return _BACKENDS.names()


def open_backend(name: str, /, **options: Any) -> ComputeBackend:
    """Make the backend registered as ``name``, passing ``options`` to its constructor.

    Raises :class:`~nbos.core.errors.PluginError` for an unknown name, a name two
    packages register, a backend that cannot be imported (a missing optional
    dependency, such as ``aiodocker`` for ``docker``: install ``nbos[docker]``), options
    it does not take, or something that is not a ``ComputeBackend``.
    """
    return _BACKENDS.make(name, **options)
