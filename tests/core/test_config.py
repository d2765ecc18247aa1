"""Settings from defaults, TOML and NBOS_* variables; bad values are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.core.config import Settings
from nbos.core.errors import ConfigError


def test_defaults_without_file_or_environment() -> None:
    settings = Settings.load(env={})
    assert settings.cluster.hosts == 3
    assert settings.raft.fsync == "batch"


def test_toml_then_environment_override(tmp_path: Path) -> None:
    path = tmp_path / "nbos.toml"
    path.write_text("[cluster]\nhosts = 5\ngpus_per_host = 4\n[raft]\ntick_ms = 7\n")
    settings = Settings.load(path, env={"NBOS_CLUSTER__HOSTS": "6", "OTHER": "x"})
    assert settings.cluster.hosts == 6
    assert settings.cluster.gpus_per_host == 4
    assert settings.raft.tick_ms == 7


@pytest.mark.parametrize(
    ("env", "key", "value"),
    [
        ({"NBOS_RAFT__TICK_MS": "fast"}, "raft.tick_ms", "fast"),
        ({"NBOS_RAFT__FSYNC": "sometimes"}, "raft.fsync", "sometimes"),
        ({"NBOS_RAFT__NO_SUCH_KEY": "1"}, "raft.no_such_key", "1"),
        ({"NBOS_STORE__KIND": "s3"}, "store.kind", "s3"),
        # Accepted once and read by nothing (how a host's agent starts is the cluster file's).
        ({"NBOS_CLUSTER__BACKEND": "bogus"}, "cluster.backend", "bogus"),
        ({"NBOS_GATEWAY__ADRESS": "127.0.0.1:1"}, "gateway.adress", "127.0.0.1:1"),
        ({"NBOS_GATEWAY__MISSED_HEARTBEATS": "few"}, "gateway.missed_heartbeats", "few"),
        ({"NBOS___TICK_MS": "1"}, "NBOS___TICK_MS", "1"),
        ({"NBOS_RAFT__": "1"}, "NBOS_RAFT__", "1"),
    ],
)
def test_bad_environment_value_names_key_and_value(
    env: dict[str, str], key: str, value: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.load(env=env)
    assert info.value.key == key
    assert info.value.value == value
    assert key in str(info.value)


def test_other_nbos_variables_are_not_settings() -> None:
    settings = Settings.load(env={"NBOS_HOST_ID": "host-1", "NBOS_CHAOS_ROUNDS": "60"})
    assert settings == Settings()


def test_bad_toml_value_names_expected_type(tmp_path: Path) -> None:
    path = tmp_path / "nbos.toml"
    path.write_text('[cluster]\nhosts = "three"\n')
    with pytest.raises(ConfigError) as info:
        Settings.load(path, env={})
    assert info.value.key == "cluster.hosts"
    assert "int" in info.value.expected


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nbos.toml"
    path.write_text("[clutser]\nhosts = 3\n")
    with pytest.raises(ConfigError) as info:
        Settings.load(path, env={})
    assert info.value.key == "clutser"


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable"):
        Settings.load(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[cluster\n")
    with pytest.raises(ConfigError, match="valid TOML"):
        Settings.load(broken, env={})


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("[gateway]\nmax_starting = 0", "gateway.max_starting"),
        ("[gateway]\nmax_starting = -3", "gateway.max_starting"),
        ("[gateway]\nmax_starting = 2.5", "gateway.max_starting"),
        ("[gateway]\nmax_starting = 100000", "gateway.max_starting"),
        ("[gateway]\nstart_wait_s = -1", "gateway.start_wait_s"),
        ("[gateway]\nstart_wait_s = nan", "gateway.start_wait_s"),
        ("[gateway]\nstart_wait_s = 61", "gateway.start_wait_s"),
        ('[gateway]\nstart_wait_s = "1s"', "gateway.start_wait_s"),
        ("[gateway]\nclient_backlog_mib = 0", "gateway.client_backlog_mib"),
        ("[gateway]\nclient_backlog_mib = 1.5", "gateway.client_backlog_mib"),
        ("[cluster]\nmax_replicas_per_host = -1", "cluster.max_replicas_per_host"),
        ("[cluster]\nmin_free_memory_mib = -1", "cluster.min_free_memory_mib"),
        ("[cluster]\nmin_free_memory_mb = 100", "cluster.min_free_memory_mb"),
    ],
)
def test_bad_admission_settings_are_refused_by_name(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "nbos.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError) as err:
        Settings.load(path, env={})
    assert err.value.key == key


def test_admission_settings_are_read() -> None:
    env = {
        "NBOS_GATEWAY__MAX_STARTING": "2",
        "NBOS_GATEWAY__START_WAIT_S": "0",
        "NBOS_CLUSTER__MAX_REPLICAS_PER_HOST": "0",
        "NBOS_CLUSTER__MIN_FREE_MEMORY_MIB": "1024",
    }
    settings = Settings.load(env=env)
    assert (settings.gateway.max_starting, settings.gateway.start_wait_s) == (2, 0.0)
    assert (settings.cluster.max_replicas_per_host, settings.cluster.min_free_memory_mib) == (
        0,
        1024,
    )
