"""Finding backends by name through the ``nbos.backends`` entry point group."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from nbos.core.compute_backend import ComputeBackend
from nbos.core.errors import BackendError, ConfigError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "nbos.backends"


def backend_names() -> list[str]:
    """The names registered in the ``nbos.backends`` entry point group, sorted."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def open_backend(name: str, **options: Any) -> ComputeBackend:
    """Make the backend registered as ``name``, passing ``options`` to its constructor.

    Raises :class:`ConfigError` for an unknown name or options the backend does not
    take, and :class:`BackendError` when the backend cannot be loaded (a missing
    optional dependency, such as ``aiodocker`` for ``docker``).
    """
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        logger.warning("no compute backend named %r (known: %s)", name, backend_names())
        raise ConfigError("cluster.backend", name, f"one of {backend_names()}")
    entry_point = next(iter(found))
    try:
        factory = entry_point.load()
    except ImportError as exc:
        logger.warning("cannot load compute backend %r: %s", name, exc)
        raise BackendError(
            f"backend {name!r} needs a missing package ({exc}); install nbos[{name}]"
        ) from exc
    try:
        backend = factory(**options)
    except TypeError as exc:
        raise ConfigError(f"backend {name}", options, f"the options it takes ({exc})") from exc
    if not isinstance(backend, ComputeBackend):
        raise BackendError(f"entry point {entry_point.value} did not make a ComputeBackend")
    return backend
