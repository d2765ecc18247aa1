"""Opening the configured object store through the ``nbos.object_stores`` entry points."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Protocol

from nbos.core.config import StoreSettings
from nbos.core.errors import ConfigError
from nbos.core.object_store import ObjectStore

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "nbos.object_stores"


class StoreFactory(Protocol):
    """What an ``nbos.object_stores`` entry point names: usually the store class itself."""

    def from_settings(self, settings: StoreSettings) -> ObjectStore:
        """A store configured by ``settings``; raises ``ConfigError`` for bad settings."""
        ...


def open_store(settings: StoreSettings) -> ObjectStore:
    """The object store of kind ``settings.kind``, found among the installed plugins.

    Raises :class:`ConfigError` for an unknown kind, a plugin that cannot be loaded
    (e.g. the ``redis`` extra is not installed) or bad settings for that kind.
    """
    plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    plugin = plugins.get(settings.kind)
    if plugin is None:
        known = ", ".join(sorted(plugins)) or "none installed"
        logger.warning("unknown object store kind %r", settings.kind)
        raise ConfigError("store.kind", settings.kind, f"one of: {known}")
    try:
        factory: StoreFactory = plugin.load()
    except ImportError as exc:
        logger.warning("cannot load object store plugin %r: %s", settings.kind, exc)
        raise ConfigError(
            "store.kind", settings.kind, f"an installed plugin ({plugin.value}: {exc})"
        ) from exc
    return factory.from_settings(settings)
