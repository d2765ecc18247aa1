"""The cluster file is read strictly: every bad value and unknown key is refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.deploy import load_cluster_file
from nbos.deploy._up import Cluster

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

MINIMAL = """
[[hosts]]
name = "a"
address = "127.0.0.1"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_the_example_in_docs_deploy_md_parses(tmp_path: Path) -> None:
    # The first cluster file (other toml blocks show settings tables such as [agent]).
    blocks = [
        b for b in re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S) if "[[hosts]]" in b
    ]
    assert blocks, "docs/deploy.md has no ```toml block with [[hosts]]"
    cluster = load_cluster_file(write(tmp_path, blocks[0]))
    assert [h.start for h in cluster.hosts] == ["ssh", "ssh", "ssh", "ssh"]
    assert cluster.store.kind == "redis"


def test_defaults_and_the_gateway_settings_they_make(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    cluster = Cluster(path)
    (host,) = cluster.file.hosts
    assert (host.start, host.gpus, host.agent_port, host.command) == (
        "local",
        "discover",
        0,
        ["nbos"],
    )
    settings = Settings.load(env=cluster.gateway_env())
    assert settings.gateway.local_agents is False
    assert settings.gateway.keys == str(tmp_path / "keys")
    assert settings.store.path == str(tmp_path / "run" / "store")
    assert settings.cluster.data_dir == str(tmp_path / "run" / "gateway")


HTTP = '[gateway]\nhttp_address = "127.0.0.1:8888"\n'


def test_the_gateway_table_takes_the_http_apis_settings(tmp_path: Path) -> None:
    text = (
        HTTP
        + 'auth_token = "secret"\nhttp_certfile = "tls/c.pem"\nhttp_keyfile = "tls/k.pem"\n'
        + "cull_idle_timeout = 600\n"
        + MINIMAL
    )
    gateway = Settings.load(env=Cluster(write(tmp_path, text)).gateway_env()).gateway
    assert (gateway.http_address, gateway.auth_token, gateway.cull_idle_timeout) == (
        "127.0.0.1:8888",
        "secret",
        600,
    )
    # Paths from the file's directory, as its keys and run directory.
    assert gateway.http_certfile == str(tmp_path / "tls" / "c.pem")
    assert gateway.http_keyfile == str(tmp_path / "tls" / "k.pem")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (MINIMAL + "colour = 1\n", "hosts[0].colour"),
        ("[gateway]\nport = 1\n" + MINIMAL, "gateway.port"),
        ("[placement]\npolicy = 3\n" + MINIMAL, "placement.policy"),
        (MINIMAL + "gpus = -1\n", "hosts[0].gpus"),
        (MINIMAL + 'gpus = "nvml"\n', "hosts[0].gpus"),
        (MINIMAL + 'start = "kubernetes"\n', "hosts[0].start"),
        (MINIMAL + 'start = "ssh"\n', "hosts[0].ssh"),
        (MINIMAL + "agent_port = 70000\n", "hosts[0].agent_port"),
        (MINIMAL + "[hosts.ssh]\n", "hosts[0].ssh"),
        (MINIMAL + 'start = "ssh"\n[hosts.ssh]\nport = "x"\n', "hosts[0].ssh.port"),
        (MINIMAL + 'start = "ssh"\n[hosts.ssh]\nusr = "x"\n', "hosts[0].ssh.usr"),
        (MINIMAL + 'start = "docker"\n[hosts.docker]\nengine = "x"\n', "hosts[0].docker.engine"),
        (MINIMAL + MINIMAL, "hosts[1].name"),
        (MINIMAL.replace('"a"', '"../a"'), "hosts[0].name"),
        (MINIMAL.replace('"a"', '"gateway"'), "hosts[0].name"),
        (MINIMAL.replace("127.0.0.1", "0.0.0.0"), "hosts[0].address"),
        ('[gateway]\naddress = "7070"\n' + MINIMAL, "gateway.address"),
        ('[gateway]\nmetrics_address = "*:9100"\n' + MINIMAL, "gateway.metrics_address"),
        ("[gateway]\nheartbeat_s = 0\n" + MINIMAL, "gateway.heartbeat_s"),
        ('[gateway]\nhttp_address = "8888"\n' + MINIMAL, "gateway.http_address"),
        ('[gateway]\nhttp_certfile = "c.pem"\n' + MINIMAL, "gateway.http_certfile"),
        ("[gateway]\ncull_idle_timeout = 60\n" + MINIMAL, "gateway.cull_idle_timeout"),
        (HTTP + "cull_idle_timeout = -1\n" + MINIMAL, "gateway.cull_idle_timeout"),
        (HTTP + 'http_keyfile = "k.pem"\n' + MINIMAL, "gateway.http_keyfile"),
        ("[placement]\nreplicas_per_kernel = 0\n" + MINIMAL, "placement.replicas_per_kernel"),
        ('[store]\nkind = "s3"\n' + MINIMAL, "store.kind"),
        ('[store]\nkind = "redis"\nredis_url = "http://x"\n' + MINIMAL, "store.redis_url"),
        ("[store]\nshared = true\n" + MINIMAL, "store.path"),
        ("hosts = []\n", "hosts"),
        ("", "hosts"),
    ],
)
def test_a_bad_value_or_unknown_key_is_refused_with_its_key(
    tmp_path: Path, text: str, key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster_file(write(tmp_path, text))
    assert info.value.key == key, info.value


SSH_HOST = """
[[hosts]]
name = "far"
address = "10.0.0.2"
start = "ssh"
[hosts.ssh]
user = "nbos"
"""


def test_a_directory_store_is_refused_for_hosts_on_other_machines(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="redis") as info:
        load_cluster_file(write(tmp_path, MINIMAL + SSH_HOST))
    assert info.value.key == "store.kind"
    shared = '[store]\nshared = true\npath = "/mnt/nbos"\n'
    assert load_cluster_file(write(tmp_path, shared + MINIMAL + SSH_HOST)).store.shared
    docker_here = MINIMAL + '[hosts.docker]\nimage = "nbos"\n'
    docker_here = docker_here.replace('"127.0.0.1"', '"127.0.0.1"\nstart = "docker"')
    assert load_cluster_file(write(tmp_path, docker_here)).hosts[0].start == "docker"


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_cluster_file(tmp_path / "missing.toml")
    with pytest.raises(ConfigError):
        load_cluster_file(write(tmp_path, "[[hosts]\n"))
