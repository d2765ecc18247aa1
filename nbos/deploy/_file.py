"""The cluster file: a TOML description of one cluster, read strictly.

Every key is known and every value checked; anything else is a
:class:`~nbos.core.errors.ConfigError` naming the key (``hosts[2].ssh.port``).
Relative paths are taken from the file's directory, so a file and its keys and
run directory can move together. The layout is documented in ``docs/deploy.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec

from nbos.agent import tcp_address
from nbos.core.config import convert_strictly, read_toml
from nbos.core.errors import ConfigError
from nbos.gateway.http import http_address
from nbos.transport.keys import check_host_name

StartKind = Literal["local", "ssh", "docker"]


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class GatewayTable(_Table, frozen=True):
    """``[gateway]``: where it listens, its keys, its run directory, its metrics, and the
    Kernel Gateway HTTP API (``jupyter lab --gateway-url``), as ``nbos gateway``'s
    ``[gateway]`` keys of the same names (certificate paths from the file's directory)."""

    address: str = "127.0.0.1:7070"
    agent_address: str = "127.0.0.1:7071"
    keys: str = "keys"
    run_dir: str = "run"
    metrics_address: str = ""
    heartbeat_s: float = 1.0
    missed_heartbeats: int = 5
    http_address: str = ""
    auth_token: str = ""
    http_certfile: str = ""
    http_keyfile: str = ""
    cull_idle_timeout: float = 0.0


class StoreTable(_Table, frozen=True):
    """``[store]``: Redis for hosts on several machines, a directory only if all share it."""

    kind: Literal["local", "redis"] = "local"
    path: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    shared: bool = False


class PlacementTable(_Table, frozen=True):
    """``[placement]``: the policy (an entry point name) and replicas per kernel."""

    policy: str = "least-loaded"
    replicas_per_kernel: int = 3


class SshTable(_Table, frozen=True):
    """``[hosts.ssh]``: how the agent's host is reached (``address`` unless ``host`` is set)."""

    host: str = ""
    port: int = 22
    user: str = ""
    key_file: str = ""
    known_hosts: str = "~/.ssh/known_hosts"


class DockerTable(_Table, frozen=True):
    """``[hosts.docker]``: the engine the agent's container runs on, and its image."""

    engine: str = "unix:///var/run/docker.sock"
    image: str = ""
    mounts: list[str] = msgspec.field(default_factory=list)


class HostTable(_Table, frozen=True):
    """One ``[[hosts]]`` entry: a GPU host and how its agent is started."""

    name: str
    address: str
    agent_port: int = 0
    gpus: int | Literal["discover"] = "discover"
    start: StartKind = "local"
    command: list[str] = msgspec.field(default_factory=lambda: ["nbos"])
    env: dict[str, str] = msgspec.field(default_factory=dict)
    dir: str = ""
    ssh: SshTable | None = None
    docker: DockerTable | None = None


class ClusterFile(_Table, frozen=True):
    """A whole cluster file; :func:`load_cluster_file` reads and checks one."""

    hosts: list[HostTable]
    gateway: GatewayTable = msgspec.field(default_factory=GatewayTable)
    store: StoreTable = msgspec.field(default_factory=StoreTable)
    placement: PlacementTable = msgspec.field(default_factory=PlacementTable)

    def keys_dir(self, base: Path) -> Path:
        return base / self.gateway.keys

    def run_dir(self, base: Path) -> Path:
        return base / self.gateway.run_dir

    def store_path(self, base: Path, run_dir: Path) -> str:
        """The directory store's path (``RUN_DIR/store`` unless named); ``""`` for Redis."""
        if self.store.kind != "local":
            return ""
        return str(base / self.store.path) if self.store.path else str(run_dir / "store")

    def gateway_settings(self, base: Path, run_dir: Path) -> dict[str, dict[str, object]]:
        """The gateway's settings, by section: agents started elsewhere, these keys,
        store and policy, its state under ``RUN_DIR/gateway``."""
        g = self.gateway
        return {
            "gateway": {
                "address": g.address,
                "agent_address": g.agent_address,
                "keys": str(self.keys_dir(base)),
                "heartbeat_s": g.heartbeat_s,
                "missed_heartbeats": g.missed_heartbeats,
                "local_agents": False,
                "metrics_address": g.metrics_address,
                "http_address": g.http_address,
                "auth_token": g.auth_token,
                "http_certfile": str(base / g.http_certfile) if g.http_certfile else "",
                "http_keyfile": str(base / g.http_keyfile) if g.http_keyfile else "",
                "cull_idle_timeout": g.cull_idle_timeout,
            },
            "cluster": {
                "placement_policy": self.placement.policy,
                "replicas_per_kernel": self.placement.replicas_per_kernel,
                "data_dir": str(run_dir / "gateway"),
            },
            "store": {
                "kind": self.store.kind,
                "path": self.store_path(base, run_dir),
                "redis_url": self.store.redis_url,
            },
        }


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read and check the cluster file at ``path``; :class:`ConfigError` names a bad key."""
    cluster = convert_strictly(read_toml(Path(path)), ClusterFile)
    _check(cluster)
    return cluster


def _check(cluster: ClusterFile) -> None:
    g = cluster.gateway
    tcp_address(g.address, "gateway.address")
    tcp_address(g.agent_address, "gateway.agent_address")
    if g.metrics_address:
        tcp_address(g.metrics_address, "gateway.metrics_address")
    if not g.heartbeat_s > 0:
        raise ConfigError("gateway.heartbeat_s", g.heartbeat_s, "positive seconds")
    if g.missed_heartbeats < 1:
        raise ConfigError("gateway.missed_heartbeats", g.missed_heartbeats, "at least 1")
    if not g.run_dir:
        raise ConfigError("gateway.run_dir", g.run_dir, "a directory")
    _check_http(g)
    if not cluster.hosts:
        raise ConfigError("hosts", [], "at least one [[hosts]] entry")
    if cluster.placement.replicas_per_kernel < 1:
        n = cluster.placement.replicas_per_kernel
        raise ConfigError("placement.replicas_per_kernel", n, "at least 1")
    names: set[str] = set()
    for i, host in enumerate(cluster.hosts):
        _check_host(f"hosts[{i}]", host)
        if host.name in names:
            raise ConfigError(f"hosts[{i}].name", host.name, "a name no other host has")
        names.add(host.name)
    _check_store(cluster)


def _check_http(g: GatewayTable) -> None:
    """The HTTP API's keys, refused here as ``nbos gateway`` would refuse them at its start."""
    if g.http_address:
        http_address(g.http_address)
    else:  # they would do nothing (auth_token, the operator's token, serves every endpoint)
        for key in ("http_certfile", "http_keyfile", "cull_idle_timeout"):
            if getattr(g, key):
                raise ConfigError(f"gateway.{key}", getattr(g, key), "gateway.http_address set")
    if not (math.isfinite(g.cull_idle_timeout) and g.cull_idle_timeout >= 0):
        raise ConfigError("gateway.cull_idle_timeout", g.cull_idle_timeout, "seconds, 0 for never")
    if g.http_keyfile and not g.http_certfile:
        raise ConfigError("gateway.http_keyfile", g.http_keyfile, "set with http_certfile")


def _check_host(key: str, host: HostTable) -> None:
    try:
        check_host_name(host.name)
    except ConfigError:
        raise ConfigError(f"{key}.name", host.name, "letters, digits, '_', '.', '-'") from None
    if host.name == "gateway":  # `nbos cluster restart gateway` names the gateway
        raise ConfigError(f"{key}.name", host.name, "a name other than 'gateway'")
    if not host.address or ":" in host.address:
        raise ConfigError(f"{key}.address", host.address, "the IPv4 address or name peers reach")
    tcp_address(f"{host.address}:{host.agent_port}", f"{key}.address")
    if not 0 <= host.agent_port < 1 << 16:
        raise ConfigError(f"{key}.agent_port", host.agent_port, "a TCP port (0: any free one)")
    if isinstance(host.gpus, int) and host.gpus < 0:
        raise ConfigError(f"{key}.gpus", host.gpus, "a number of virtual GPUs, or 'discover'")
    if not host.command or not all(host.command):
        raise ConfigError(f"{key}.command", host.command, "the argv that runs nbos there")
    for other in ("ssh", "docker"):
        given = getattr(host, other) is not None
        if given != (host.start == other):
            expected = f"a [{key}.{other}] table" if host.start == other else "no such table"
            raise ConfigError(
                f"{key}.{other}", getattr(host, other), f"{expected} for {host.start}"
            )
    if host.ssh is not None and not 0 < host.ssh.port < 1 << 16:
        raise ConfigError(f"{key}.ssh.port", host.ssh.port, "a TCP port")
    if host.docker is not None:
        scheme = host.docker.engine.partition("://")[0]
        if scheme not in ("unix", "tcp", "http", "https"):
            raise ConfigError(f"{key}.docker.engine", host.docker.engine, "unix:// or tcp:// URL")
        if not host.docker.image:
            raise ConfigError(f"{key}.docker.image", host.docker.image, "an image on that engine")


def _check_store(cluster: ClusterFile) -> None:
    store = cluster.store
    if store.kind == "redis":
        if not store.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("store.redis_url", store.redis_url, "a redis:// URL")
        return
    # A directory store is only as shared as the file system under it: replicas on
    # other machines would each see their own, and a migrated kernel lose its values.
    remote = [h.name for h in cluster.hosts if not _same_machine(h)]
    if remote and not store.shared:
        raise ConfigError(
            "store.kind",
            store.kind,
            f"'redis' (hosts {remote} run on other machines; or set store.shared = true "
            "with a store.path that every host mounts)",
        )
    if store.shared and not store.path:
        raise ConfigError("store.path", store.path, "the directory every host mounts")


def _same_machine(host: HostTable) -> bool:
    """Whether the host's agent runs on this machine (its files are ours)."""
    if host.start == "local":
        return True
    return host.docker is not None and host.docker.engine.startswith("unix://")
