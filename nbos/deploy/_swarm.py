"""nbos as a Docker Swarm stack: ``nbos swarm deploy|rm FILE``.

The swarm file is a TOML file: a ``[swarm]`` table (the stack's own keys,
:class:`SwarmTable`) and any other nbos settings tables (``[gateway]``, ``[raft]``,
``[cluster]``, ``[auth]``, ``[agent]``), which every service reads as its settings file
(a Docker config). The keys the stack itself sets (addresses, keys, state, store, the
agent's runtime) are refused there: they would not take effect.

:func:`render_stack` makes the compose (v3.8) stack, as JSON, which ``docker stack
deploy`` reads as the YAML it is a subset of:

* ``redis``, the object store, and ``gateway``, pinned to the one node labelled
  ``nbos.gateway=true`` (their state is on its disk), restarted by Swarm;
* ``agent``, a global service on the nodes labelled ``nbos.gpu=true``, each agent named
  by its node, reaching its node's engine through the mounted socket and running every
  replica there as a container (``[agent] runtime = "docker"``), so replicas outlive the
  agent's container;
* host networking everywhere (no routing mesh, no virtual IPs): services bind their
  node's addresses, and everyone reaches the gateway at its node's address, which
  :func:`swarm_deploy` reads from the swarm.

See ``docs/deploy.md``, "Docker Swarm".
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from nbos.core.config import Settings, convert_strictly, read_toml
from nbos.core.errors import ConfigError, NbosError
from nbos.gateway.service import autoscaler_config
from nbos.transport.join import TOKEN_FILE

GATEWAY_LABEL = "nbos.gateway"
GPU_LABEL = "nbos.gpu"
#: Where the settings file and the secrets appear in every container.
SETTINGS_PATH = "/etc/nbos/nbos.toml"
JOIN_TOKEN_SECRET = f"/run/secrets/{TOKEN_FILE.replace('.', '-')}"
#: The files of ``nbos keys DIR --join-token`` the stack takes as secrets.
_GATEWAY_PAIR = ("gateway.key", "gateway.key_secret")
_KEY_FILES = (*_GATEWAY_PAIR, TOKEN_FILE)
#: Settings the stack sets itself; a swarm file that sets them is refused.
STACK_OWNED = {
    "gateway": (
        "address",
        "agent_address",
        "keys",
        "join_token_file",
        "join_address",
        "local_agents",
        "http_address",
        "auth_token",
        "swarm_engine",
        "autoscale",
        "host_provider",
        "host_provider_options",
    ),
    "cluster": ("data_dir",),
    "store": ("kind", "path", "redis_url"),
    "agent": (
        "runtime",
        "docker_engine",
        "docker_image",
        "python",
        "warm_replicas",
        "join_token_file",
    ),
}

#: What ``[swarm] autoscale = true`` sets in ``[gateway]``: the standby nodes, through the
#: engine the gateway's container mounts (its node's, a manager's).
_ENGINE = "unix:///var/run/docker.sock"
_AUTOSCALE: dict[str, Any] = {
    "autoscale": True,
    "host_provider": "swarm",
    "host_provider_options": {"engine": _ENGINE, "label": GPU_LABEL},
}

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class SwarmError(NbosError):
    """The swarm cannot take the stack (no labelled node, ``docker`` failed)."""


class SwarmTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[swarm]``: the stack's name, image, ports, state and keys (``docs/deploy.md``)."""

    stack: str = "nbos"
    image: str = "nbos:latest"
    python: str = "/opt/nbos/bin/python"
    state_dir: str = "/var/lib/nbos"
    gateway_port: _Port = 7070
    agent_endpoint_port: _Port = 7071
    http_port: _Port = 8888
    redis_port: _Port = 6379
    agent_port: _Port = 7100
    virtual_gpus: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    #: The gateway autoscales with the standby nodes (``host_provider = "swarm"``).
    autoscale: bool = False
    keys: str = ""
    insecure: bool = False


@dataclass(frozen=True)
class SwarmFile:
    """A swarm file read and checked: its ``[swarm]`` table and the services' settings."""

    path: Path
    swarm: SwarmTable
    settings: dict[str, Any]

    @property
    def keys(self) -> Path | None:
        return (self.path.parent / self.swarm.keys) if self.swarm.keys else None


def load_swarm_file(path: str | Path) -> SwarmFile:
    """Read ``path`` strictly; raises :class:`ConfigError` naming a bad key."""
    path = Path(path).resolve()
    raw = read_toml(path)
    swarm = convert_strictly(raw.pop("swarm", {}), SwarmTable)
    for section, keys in STACK_OWNED.items():
        for key in keys:
            if key in raw.get(section, {}):
                by = "[swarm] autoscale = true" if key in _AUTOSCALE else "the stack"
                raise ConfigError(f"{section}.{key}", raw[section][key], f"unset: {by} sets it")
    # Every other table as nbos settings, checked with what [swarm] autoscale adds, as the
    # gateway will read them: autoscaler keys without it are refused here, not at its start.
    gateway = {**raw.get("gateway", {}), **(_AUTOSCALE if swarm.autoscale else {})}
    autoscaler_config(convert_strictly({**raw, "gateway": gateway}, Settings))
    if not swarm.stack.replace("-", "").replace("_", "").isalnum():
        raise ConfigError("swarm.stack", swarm.stack, "letters, digits, '-' and '_'")
    if not swarm.state_dir.startswith("/"):
        raise ConfigError("swarm.state_dir", swarm.state_dir, "an absolute path on the nodes")
    if not swarm.keys and not swarm.insecure:
        raise ConfigError(
            "swarm.keys", "", "a key directory (nbos keys DIR --join-token), or insecure = true"
        )
    if swarm.keys and swarm.insecure:
        raise ConfigError("swarm.insecure", True, "false with keys")
    swarm_file = SwarmFile(path, swarm, raw)
    if swarm_file.keys is not None:
        for name in _KEY_FILES:
            if not (swarm_file.keys / name).is_file():
                raise ConfigError("swarm.keys", swarm.keys, f"a directory holding {name}")
    return swarm_file


def render_stack(swarm_file: SwarmFile, gateway_ip: str) -> tuple[dict[str, Any], str]:
    """The stack (compose v3.8, a dict) and the services' settings file (TOML text)."""
    table = swarm_file.swarm
    settings_text = render_settings(services_settings(swarm_file, gateway_ip))
    digest = hashlib.sha256(settings_text.encode()).hexdigest()[:12]
    host_net = {"host": {"external": True, "name": "host"}}
    on_gateway = {"constraints": [f"node.labels.{GATEWAY_LABEL}==true"]}
    restart = {"condition": "any", "delay": "2s"}
    state = {"type": "bind", "source": table.state_dir, "target": table.state_dir}
    settings_ref = [{"source": "settings", "target": SETTINGS_PATH, "mode": 0o400}]
    nbos = ["nbos", "--config", SETTINGS_PATH]
    redis_dir = f"{table.state_dir}/redis"
    redis = (
        f"redis-server --bind {gateway_ip} --port {table.redis_port} --protected-mode no "
        f"--dir {redis_dir} --appendonly yes"
    )
    socket = "/var/run/docker.sock"
    services: dict[str, Any] = {
        "redis": {
            "image": table.image,
            # redis-server makes no directory: its own, in the node's state, made first.
            "command": ["sh", "-c", f"mkdir -p {redis_dir} && exec {redis}"],
            "networks": ["host"],
            "volumes": [state],
            "deploy": {"placement": on_gateway, "restart_policy": restart},
        },
        "gateway": {
            "image": table.image,
            "command": [*nbos, "gateway"],
            "networks": ["host"],
            # Its node's engine, a manager's: it reads which nodes are drained (an agent
            # stopped there has its replicas moved off first) and, with the swarm host
            # provider, activates and drains standby nodes.
            "volumes": [state, {"type": "bind", "source": socket, "target": socket}],
            "configs": settings_ref,
            "stop_grace_period": "30s",
            "deploy": {"placement": on_gateway, "restart_policy": restart},
        },
        "agent": {
            "image": table.image,
            "command": ["sh", "-c", "exec " + " ".join(_agent_argv(swarm_file, gateway_ip))],
            "environment": {"NBOS_NODE": "{{.Node.Hostname}}"},
            "networks": ["host"],
            "volumes": [
                state,
                {"type": "bind", "source": socket, "target": socket},
            ],
            "configs": settings_ref,
            # An agent stopped on a drained node waits while the gateway moves its replicas.
            "stop_grace_period": "300s",
            "deploy": {
                "mode": "global",
                "placement": {"constraints": [f"node.labels.{GPU_LABEL}==true"]},
                "restart_policy": restart,
            },
        },
    }
    stack: dict[str, Any] = {
        "version": "3.8",
        "services": services,
        "networks": host_net,
        "configs": {"settings": {"name": f"{table.stack}-settings-{digest}", "file": "nbos.toml"}},
    }
    keys = swarm_file.keys
    if keys is not None:
        _add_secrets(stack, keys, table)
    return stack, settings_text


def _add_secrets(stack: dict[str, Any], keys: Path, table: SwarmTable) -> None:
    """The gateway's key pair and the join token as Docker secrets. The gateway copies its
    pair into its key directory on its node's disk at each start: that directory must be
    writable, as the gateway pins there the key each agent joins with."""
    stack["secrets"] = {
        _secret(name): {
            "name": f"{table.stack}-{_secret(name)}-{_file_digest(keys / name)}",
            "file": str(keys / name),
        }
        for name in _KEY_FILES
    }
    services = stack["services"]
    services["gateway"]["secrets"] = [
        {"source": _secret(name), "target": f"/run/secrets/{_secret(name)}", "mode": 0o400}
        for name in _KEY_FILES
    ]
    directory = _gateway_keys(table)
    copies = [f"cp /run/secrets/{_secret(name)} {directory}/{name}" for name in _GATEWAY_PAIR]
    install = " && ".join([f"install -d -m 700 {directory} {directory}/hosts", *copies])
    command = " ".join(services["gateway"]["command"])
    services["gateway"]["command"] = ["sh", "-c", f"{install} && exec {command}"]
    services["agent"]["secrets"] = [
        {"source": _secret(TOKEN_FILE), "target": JOIN_TOKEN_SECRET, "mode": 0o400}
    ]


def _secret(name: str) -> str:
    return name.replace(".", "-").replace("_", "-")


def _gateway_keys(table: SwarmTable) -> str:
    return f"{table.state_dir}/gateway/keys"


def services_settings(swarm_file: SwarmFile, gateway_ip: str) -> dict[str, Any]:
    """The swarm file's settings tables plus what the stack sets."""
    table = swarm_file.swarm
    settings = {section: dict(values) for section, values in swarm_file.settings.items()}
    owned: dict[str, dict[str, Any]] = {
        "gateway": {
            "address": f"{gateway_ip}:{table.gateway_port}",
            "agent_address": f"{gateway_ip}:{table.agent_endpoint_port}",
            "local_agents": False,
            "http_address": f"0.0.0.0:{table.http_port}",
            "swarm_engine": _ENGINE,
            **(_AUTOSCALE if table.autoscale else {}),
        },
        "cluster": {"data_dir": f"{table.state_dir}/gateway"},
        "store": {"kind": "redis", "redis_url": f"redis://{gateway_ip}:{table.redis_port}/0"},
        "agent": {
            "runtime": "docker",
            "docker_engine": _ENGINE,
            "docker_image": table.image,
            "python": table.python,
        },
    }
    if swarm_file.keys is not None:
        owned["gateway"]["keys"] = _gateway_keys(table)
        owned["gateway"]["join_token_file"] = JOIN_TOKEN_SECRET
    for section, values in owned.items():
        settings.setdefault(section, {}).update(values)
    return settings


def _agent_argv(swarm_file: SwarmFile, gateway_ip: str) -> list[str]:
    table = swarm_file.swarm
    argv = [
        "nbos", "--config", SETTINGS_PATH, "agent", '--host "$$NBOS_NODE"',
        "--address", f"auto:{table.agent_port}",
        "--gateway", f"{gateway_ip}:{table.agent_endpoint_port}",
        "--state-dir", f"{table.state_dir}/agent",
    ]  # fmt: skip
    if table.virtual_gpus:
        argv += ["--gpus", str(table.virtual_gpus)]
    if swarm_file.keys is None:
        argv.append("--insecure")
    else:
        argv += ["--join-token-file", JOIN_TOKEN_SECRET]
    return argv


def render_settings(settings: Mapping[str, Mapping[str, Any]]) -> str:
    """``settings`` (tables of TOML values) as TOML text."""
    lines: list[str] = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{json.dumps(key)} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    # JSON's strings, numbers and arrays are TOML's; tables become inline tables.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        pairs = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + pairs + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_stack(swarm_file: SwarmFile, gateway_ip: str, directory: Path) -> Path:
    """Write ``stack.yml`` and the settings file it names into ``directory``; its path."""
    stack, settings_text = render_stack(swarm_file, gateway_ip)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "nbos.toml").write_text(settings_text)
    path = directory / "stack.yml"
    path.write_text(json.dumps(stack, indent=2) + "\n")
    return path


def gateway_node_ip(docker: Sequence[str] = ("docker",)) -> str:
    """The address of the one node labelled ``nbos.gateway=true``; refuses none or several,
    one that is not a manager, and a swarm with no node labelled ``nbos.gpu=true``."""
    labelled = _run(
        [*docker, "node", "ls", "-q", "--filter", f"node.label={GATEWAY_LABEL}=true"]
    ).split()
    if len(labelled) != 1:
        raise SwarmError(
            f"{len(labelled)} nodes are labelled {GATEWAY_LABEL}=true; label exactly one "
            f"(docker node update --label-add {GATEWAY_LABEL}=true NODE)"
        )
    if not _run([*docker, "node", "ls", "-q", "--filter", f"node.label={GPU_LABEL}=true"]).split():
        raise SwarmError(
            f"no node is labelled {GPU_LABEL}=true, so no agent would run "
            f"(docker node update --label-add {GPU_LABEL}=true NODE)"
        )
    role, address = _run(
        [*docker, "node", "inspect", labelled[0], "--format", "{{.Spec.Role}} {{.Status.Addr}}"]
    ).split()
    if role != "manager":
        raise SwarmError(
            f"the node labelled {GATEWAY_LABEL}=true is a {role}: the gateway reads the nodes' "
            "availability through its node's engine, which must be a manager's "
            "(docker node promote NODE)"
        )
    return address


def swarm_deploy(path: str | Path, docker: Sequence[str] = ("docker",)) -> str:
    """Deploy the swarm file's stack (``docker stack deploy``); the stack's name."""
    swarm_file = load_swarm_file(path)
    gateway_ip = gateway_node_ip(docker)
    with tempfile.TemporaryDirectory(prefix="nbos-stack-") as tmp:
        stack = write_stack(swarm_file, gateway_ip, Path(tmp))
        _run([*docker, "stack", "deploy", "--prune", "-c", str(stack), swarm_file.swarm.stack])
    return swarm_file.swarm.stack


def swarm_rm(path: str | Path, docker: Sequence[str] = ("docker",)) -> str:
    """Remove the swarm file's stack: its services, configs and secrets (``docker stack rm``).

    The state on the nodes' disks (``[swarm] state_dir``) stays: the replicas the agents
    ran as containers were stopped with nothing, and a stack deployed again takes the
    gateway's kernels back from it.
    """
    swarm_file = load_swarm_file(path)
    _run([*docker, "stack", "rm", swarm_file.swarm.stack])
    return swarm_file.swarm.stack


def _run(argv: Sequence[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise SwarmError(f"{argv[0]} is not installed (the Docker CLI runs the stack)")
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SwarmError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
