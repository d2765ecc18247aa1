"""Typed settings, read from a TOML file and ``NBOS_*`` environment variables.

Precedence, lowest first: defaults, the TOML file, the environment. An
environment variable names a section and a key joined by a double underscore:
``NBOS_RAFT__TICK_MS=20`` sets ``[raft] tick_ms = 20``; ``NBOS_*`` names without
the double underscore are not settings and are left alone. Every value is checked;
a bad one raises :class:`~nbos.core.errors.ConfigError` naming the key, the
value and what was expected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from nbos.core.errors import ConfigError

ENV_PREFIX = "NBOS_"

FsyncPolicy = Literal["always", "batch", "never"]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ClusterSettings(_Section, frozen=True):
    """The embedded cluster: virtual hosts and their (virtual or real) GPUs.

    What one host takes, in every cluster (``docs/deploy.md``): no new replica goes to a
    host that holds ``max_replicas_per_host`` (0: no limit), or whose agent reports less
    than ``min_free_memory_mib`` of available memory (0: no floor). A kernel that finds
    no room is refused at once, as overloaded.
    """

    hosts: int = 3
    gpus_per_host: int = 8
    gpu_memory_mib: int = 40_960
    replicas_per_kernel: int = 3
    placement_policy: str = "least-loaded"
    data_dir: str = ""
    max_replicas_per_host: Annotated[int, msgspec.Meta(ge=0)] = 64
    min_free_memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 256


class RaftSettings(_Section, frozen=True):
    """Timing and durability of every kernel's Raft group.

    ``fsync``: ``always`` syncs the WAL before any answer that depends on it (safe
    against power loss); ``batch`` syncs once per batch of ready entries (same
    guarantee, fewer syncs under load); ``never`` leaves it to the OS (survives a
    process crash, not a machine crash).

    ``quiesce_ticks``: a kernel's Raft group with nothing in flight for this many ticks
    goes quiet: no heartbeats, no election timers, no ticks, until a proposal, a
    message or a client request wakes it (``docs/raft.md``); 0 keeps it always awake.
    The default is one election timeout. The ticks of an awake group are most of what a
    sporadic cell costs (each turns three members' loops, every other one sends
    heartbeats), while waking a quiet group costs a cell no measurable time:
    ``bench/cell_cpu.py`` measured 40-60 ms of CPU per cell every 2 s, 193 ms at 100 ticks.
    """

    tick_ms: int = 10
    election_ticks: int = 20
    heartbeat_ticks: int = 2
    max_inflight: int = 64
    max_batch_bytes: int = 1 << 20
    snapshot_every: int = 1000
    fsync: FsyncPolicy = "batch"
    quiesce_ticks: int = 20


class StoreSettings(_Section, frozen=True):
    """Where large values of kernel namespaces are kept."""

    kind: Literal["local", "redis"] = "local"
    path: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"


class GatewaySettings(_Section, frozen=True):
    """``nbos gateway``: where it listens and how it watches its agents.

    ``address``: the control endpoint (``nbos status``, kernel requests) and the
    address kernel fronts bind; ``agent_address``: where agents register. Both
    ``HOST:PORT``, bound as given and told to peers, so not a wildcard.
    ``keys``: the key directory of ``nbos keys`` (CURVE with agents; empty: plain
    TCP). ``join_token_file``: the token of ``nbos keys DIR --join-token`` (needs
    ``keys``, whose gateway key it must name; empty: no joins): agents holding it join
    with key pairs of their own at ``join_address`` (``HOST:PORT``; empty: the agent
    endpoint's host and the port after ``agent_address``'s), and the gateway pins each
    host's key in ``keys``'s ``hosts/NAME.key``. ``swarm_engine``: a Docker Swarm
    manager's engine (``unix://``, ``tcp://``; empty: none): an agent told to stop whose
    node is drained there waits while the gateway moves its replicas off (a rolling
    upgrade's stop moves nothing). An agent silent for
    ``missed_heartbeats`` times ``heartbeat_s`` (the
    agents' interval) is given up and its replicas replaced. ``local_agents``:
    start ``[cluster] hosts`` agents with ``[cluster] gpus_per_host`` virtual GPUs
    on this machine, else wait for agents started elsewhere.
    ``metrics_address``: ``HOST:PORT`` where Prometheus scrapes ``/metrics``
    (empty: no metrics endpoint).
    ``idle_exit_s``: the gateway exits on its own once it has had no kernels and no
    control request for that long (0: never). ``local_idle_exit_s``: the
    ``idle_exit_s`` of the per-user gateway that the ``nbos`` kernelspec starts in
    the background when no ``address`` is named (``docs/jupyter.md``).
    ``orphan_grace_s``: a kernel started through the kernelspec is shut down this
    long after its Jupyter client process (``JPY_PARENT_PID``) ended, or after its
    kernel host process was last heard of.

    Autoscaling (``docs/deploy.md``): with ``autoscale``, every ``autoscale_period_s``
    the gateway runs the simulator's autoscaler on the live cluster, keeping between
    ``min_hosts`` and ``max_hosts`` hosts, ``scale_out_cooldown_s`` /
    ``scale_in_cooldown_s`` after its previous action, draining hosts idle for
    ``idle_grace_s`` but keeping ``spare_hosts`` hosts with no GPU committed (a cell that
    no replica's host can take migrates to one at once, instead of waiting for a new host
    to start). New hosts come from the entry point ``host_provider``
    (``local``, ``docker``, ``ssh`` or a user's), made with the keyword arguments
    ``host_provider_options``; one whose agent has not registered after
    ``host_start_timeout_s`` is given back. With ``precopy``, every period each idle
    kernel whose replicas' hosts could not commit its GPUs has a replica moved to a host
    that could, ahead of its next cell (``docs/placement.md``, "Pre-copy"). Without
    ``autoscale`` these keys must keep their defaults (they would do nothing).

    The Jupyter Kernel Gateway API (``docs/jupyter.md``): ``http_address``
    (``HOST:PORT``; empty: not served) serves the REST and WebSocket API that
    ``jupyter server --gateway-url`` speaks; every request, as every control request,
    carries a user's token (``[auth]``) or the operator's: ``auth_token`` (unset: a
    fresh one at each start, see ``[auth]``), as ``Authorization: token ...`` or
    ``?token=``;
    ``http_certfile`` and ``http_keyfile`` (PEM) serve it over TLS;
    ``cull_idle_timeout`` shuts down a kernel that no client is connected to after
    that many idle seconds (0: never).

    ``client_backlog_mib``: MiB of a kernel's messages a WebSocket client may have not
    yet taken before its output (``stream``, ``display_data``...) is dropped, so that a
    client that reads slowly holds bounded memory (``docs/jupyter.md``).

    Admission (``docs/deploy.md``): at most ``max_starting`` kernel starts run at once
    (control API, HTTP API and kernelspec alike); one more waits up to ``start_wait_s``
    for one of them to end (0: not at all), then is refused as overloaded, with the
    seconds after which to ask again.
    """

    address: str = "127.0.0.1:7070"
    agent_address: str = "127.0.0.1:7071"
    keys: str = ""
    join_token_file: str = ""
    join_address: str = ""
    swarm_engine: str = ""
    heartbeat_s: float = 1.0
    missed_heartbeats: int = 5
    local_agents: bool = True
    metrics_address: str = ""
    idle_exit_s: float = 0.0
    local_idle_exit_s: float = 600.0
    orphan_grace_s: float = 30.0
    autoscale: bool = False
    min_hosts: int = 3
    max_hosts: int = 16
    autoscale_period_s: float = 5.0
    scale_out_cooldown_s: float = 30.0
    scale_in_cooldown_s: float = 120.0
    idle_grace_s: float = 120.0
    spare_hosts: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    host_provider: str = "local"
    host_provider_options: dict[str, Any] = msgspec.field(default_factory=dict)
    host_start_timeout_s: float = 120.0
    precopy: bool = False
    http_address: str = ""
    auth_token: str = ""
    http_certfile: str = ""
    http_keyfile: str = ""
    cull_idle_timeout: float = 0.0
    client_backlog_mib: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    max_starting: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    start_wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 1.0


class AuthSettings(_Section, frozen=True):
    """Who may use the gateway (``docs/users.md``).

    Every request (HTTP, WebSocket, control endpoint, metrics) carries a token. The
    gateway's own operator token (``[gateway] auth_token``, else one kept in the data dir,
    or fresh at each start without one; written ``0600`` to a token file in Jupyter's
    runtime directory, where local clients find it) makes an admin. ``users_file``: a
    TOML file of users, each with a token hash, a role (``user`` or ``admin``) and a GPU
    quota (empty: no users file).
    ``default_quota``: the guaranteed GPUs of a user for whom none is given.

    JupyterHub as a second identity provider: ``jupyterhub_api_url`` is the Hub's REST
    API (its ``JUPYTERHUB_API_URL``, ``http(s)://HOST:PORT/hub/api``; empty: no Hub),
    which says whose a user's Hub API token is; a Hub admin is an nbos admin, every Hub
    user has ``default_quota``. The Hub's answer for a user is kept
    ``jupyterhub_cache_s`` seconds (0: asked on every request), so a token revoked at the
    Hub works until then. Without ``jupyterhub_api_url``, ``jupyterhub_cache_s`` must
    keep its default (it would do nothing).
    """

    users_file: str = ""
    default_quota: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    jupyterhub_api_url: str = ""
    jupyterhub_cache_s: float = 60.0


class AgentSettings(_Section, frozen=True):
    """``nbos agent``: how it runs its host's replicas (``docs/deploy.md``).

    ``runtime``: ``process`` runs each replica as a local process of the agent;
    ``docker`` runs each as a container of ``docker_image`` (never pulled: it must be
    on the engine) on the Docker engine at ``docker_engine`` (``unix://`` or
    ``tcp://``), which must run on the agent's own machine: containers use the host
    network (so a replica binds the host's address as a process would) and bind-mount
    the agent's ``STATE/work`` at its own path (so the Raft log and connection file
    stay on the host), plus ``docker_mounts`` (``SRC:DST[:ro]``). ``python``: the
    interpreter, with nbos, that replicas run (``""``: the agent's own; in an image,
    its path there). Without ``runtime = "docker"`` the ``docker_*`` keys must keep
    their defaults (they would do nothing).

    ``warm_replicas``: how many pre-started replica processes the agent keeps (each has
    imported IPython, ipykernel and nbos and waits to be told which replica to be);
    a kernel's start takes one per replica and the agent starts another in the
    background. Each costs the memory of an idle Python with those imports (about
    60 MiB resident, 32 MiB proportional; a few MiB of its own when forked, below); 0
    starts every replica from scratch. Only
    the ``process`` runtime has a pool: unset, it means 2 there and 0 with ``docker``,
    where any other value is refused.

    ``fork_replicas``: whether the pre-started replicas are forks of one template
    process that imported all that once (unset: yes), sharing its memory pages, or each
    started from scratch (``false``). Only where there is a pool: set elsewhere, it is
    refused.

    ``join_token_file``: the cluster's join token (``nbos keys DIR --join-token``; empty:
    none). With it the agent makes its own CURVE key pair (kept in its state directory)
    and joins the gateway by proving the token's secret, instead of holding a key pair
    from ``nbos keys`` (``--keys``).
    """

    runtime: Literal["process", "docker"] = "process"
    docker_engine: str = "unix:///var/run/docker.sock"
    docker_image: str = ""
    docker_mounts: list[str] = msgspec.field(default_factory=list)
    python: str = ""
    warm_replicas: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    fork_replicas: bool | None = None
    join_token_file: str = ""

    @property
    def pool_size(self) -> int:
        """The pre-started replica processes the agent keeps (``warm_replicas`` resolved)."""
        if self.warm_replicas is not None:
            return self.warm_replicas
        return 2 if self.runtime == "process" else 0

    @property
    def forks(self) -> bool:
        """Whether the pre-started replicas are forked from a template (``fork_replicas``
        resolved)."""
        return self.pool_size > 0 and self.fork_replicas is not False


class Settings(_Section, frozen=True):
    """All nbos settings."""

    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)
    raft: RaftSettings = msgspec.field(default_factory=RaftSettings)
    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    agent: AgentSettings = msgspec.field(default_factory=AgentSettings)
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
        """Read ``path`` (if given), then the ``NBOS_*`` variables of ``env`` (or os.environ)."""
        raw: dict[str, Any] = {}
        if path is not None:
            raw = read_toml(Path(path))
        _merge(raw, _from_env(os.environ if env is None else env))
        return _convert(raw)


def read_toml(path: Path) -> dict[str, Any]:
    # Imported here: replica processes never read a settings file.
    import tomllib

    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(str(path), None, f"a readable TOML file ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), None, f"valid TOML ({exc})") from exc


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for name, value in env.items():
        # Only NBOS_<SECTION>__<KEY> names are settings; other NBOS_* variables (the
        # host id a backend gives its processes, test sizes) belong to someone else.
        section, sep, key = name.removeprefix(ENV_PREFIX).lower().partition("__")
        if not name.startswith(ENV_PREFIX) or not sep:
            continue
        if not section or not key:
            raise ConfigError(name, value, f"a name of the form {ENV_PREFIX}<SECTION>__<KEY>")
        raw.setdefault(section, {})[key] = value
    return raw


def _merge(into: dict[str, Any], top: Mapping[str, Any]) -> None:
    for section, values in top.items():
        if isinstance(values, Mapping) and isinstance(into.get(section), dict):
            into[section].update(values)
        else:
            into[section] = values


# The path msgspec names in an error: ``$.raft.tick_ms``, ``$.hosts[1].ssh.port``.
_PATH = re.compile(r"at `\$([^`]*)`")
_PART = re.compile(r"\.?(\w+)|\[(\d+)\]")

T = TypeVar("T")


def _convert(raw: dict[str, Any]) -> Settings:
    return convert_strictly(raw, Settings)


def convert_strictly(raw: Mapping[str, Any], into: type[T]) -> T:
    """``raw`` (TOML or environment values) as ``into``, a msgspec Struct.

    Raises :class:`ConfigError` naming the first bad key (``section.key``, with
    ``[i]`` for list items), its value and what was expected: an unknown key as
    well as a bad value.
    """
    try:
        # strict=False lets environment strings such as "20" become ints.
        return msgspec.convert(raw, into, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        key = match.group(1).lstrip(".") if match else ""
        if message.startswith(("Object contains unknown field", "Object missing required")):
            field = message.split("`")[1]
            key = f"{key}.{field}" if key else field
            expected = "a known setting" if "unknown" in message else "a value (it is required)"
            raise ConfigError(key, _value_at(raw, key), expected) from None
        key = key or "<root>"
        expected = message.split(" - at ", maxsplit=1)[0].removeprefix("Expected ")
        raise ConfigError(key, _value_at(raw, key), expected) from None


def _value_at(raw: Mapping[str, Any], key: str) -> Any:
    value: Any = raw
    for name, index in _PART.findall(key):
        if name:
            value = value.get(name) if isinstance(value, Mapping) else None
        else:
            value = (
                value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
            )
    return value
