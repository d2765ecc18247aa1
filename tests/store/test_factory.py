"""open_store: stores found through the nbos.object_stores entry points."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.core.config import Settings, StoreSettings
from nbos.core.errors import ConfigError, PluginError
from nbos.store import LocalObjectStore, RedisObjectStore, open_store

pytestmark = pytest.mark.anyio


async def test_local_kind_opens_a_local_store_at_the_configured_path(tmp_path: Path) -> None:
    settings = Settings.load(env={"NBOS_STORE__KIND": "local", "NBOS_STORE__PATH": str(tmp_path)})
    store = open_store(settings.store)
    assert isinstance(store, LocalObjectStore)
    assert store.root == tmp_path
    assert await store.get(await store.put(b"via settings")) == b"via settings"


def test_redis_kind_opens_a_redis_store() -> None:
    store = open_store(StoreSettings(kind="redis", redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(store, RedisObjectStore)


def test_an_unknown_kind_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(PluginError, match="local, redis") as info:
        open_store(StoreSettings(kind="s3"))  # type: ignore[arg-type]
    assert (info.value.group, info.value.name) == ("nbos.object_stores", "s3")


def test_the_local_kind_needs_a_path() -> None:
    with pytest.raises(ConfigError) as info:
        open_store(StoreSettings(kind="local"))
    assert info.value.key == "store.path"
