"""Opening the configured object store through the ``nbos.object_stores`` entry points."""

from __future__ import annotations

from nbos.core.config import StoreSettings
from nbos.core.object_store import ObjectStore, StoreFactory
from nbos.core.plugins import PluginGroup

ENTRY_POINT_GROUP = "nbos.object_stores"

_FACTORIES = PluginGroup[StoreFactory](ENTRY_POINT_GROUP, StoreFactory)


def open_store(settings: StoreSettings) -> ObjectStore:
    """The object store of kind ``settings.kind``, found among the installed plugins.

    Raises :class:`~nbos.core.errors.PluginError` for an unknown kind, a kind two
    packages register, a plugin that cannot be imported (e.g. the ``redis`` extra is
    not installed) or one without ``from_settings``, and
    :class:`~nbos.core.errors.ConfigError` for bad settings for that kind.
    """
    return _FACTORIES.load(settings.kind).from_settings(settings)
