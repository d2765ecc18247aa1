"""How an agent runs its replicas: ``[agent] runtime``, checked, and the Docker side of it.

With ``runtime = "docker"`` every replica is a container on the host's own Docker
engine, started through :class:`~nbos.backends.docker.DockerBackend` (no second
Docker client): the host network, so a replica binds the host's address and the
ports the agent handed out as a process would; the agent's ``STATE/work`` bind
mounted at its own path, so the replica's working directory (connection file,
Raft log) is on the host where a restarted agent or replica finds it; Docker's
init as PID 1, which passes signals on and exits as the replica did. Each container is
labelled with its host (``nbos.host``), replica (``nbos.replica``) and kernel
(``nbos.kernel``), so ``docker ps --filter label=nbos.kernel=ID`` on a node shows them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from nbos.core.config import AgentSettings, Settings, convert_strictly
from nbos.core.errors import ConfigError
from nbos.core.ids import HostId
from nbos.core.wire.agent import ReplicaSpec

if TYPE_CHECKING:  # the docker extra (aiodocker) is needed only with runtime = "docker"
    from nbos.backends.docker import DockerBackend

_ENGINE_SCHEMES = ("unix", "tcp", "http", "https")
# What a replica container takes from the agent's environment: the nbos settings and
# where nbos is imported from, as a replica process would inherit them; nothing else
# (the agent's PATH or secrets are not the image's business).
_INHERITED_PREFIX = "NBOS_"
_INHERITED = ("PYTHONPATH",)


def check_agent_settings(settings: AgentSettings) -> None:
    """:class:`ConfigError` naming the first ``[agent]`` key that cannot take effect."""
    # A Struct built in code skips the checks of its fields' constraints: the section's
    # own conversion makes both ways in take the same values.
    convert_strictly({"agent": msgspec.to_builtins(settings)}, Settings)
    if settings.runtime != "docker":
        default = AgentSettings()
        for key in ("docker_engine", "docker_image", "docker_mounts"):
            if getattr(settings, key) != getattr(default, key):
                raise ConfigError(
                    f"agent.{key}", getattr(settings, key), 'agent.runtime = "docker"'
                )
        return
    if settings.docker_engine.partition("://")[0] not in _ENGINE_SCHEMES:
        raise ConfigError(
            "agent.docker_engine", settings.docker_engine, "a unix:// or tcp:// engine URL"
        )
    if settings.pool_size:
        raise ConfigError(
            "agent.warm_replicas", settings.warm_replicas, 'unset or 0 with runtime = "docker"'
        )
    if not settings.docker_image:
        raise ConfigError("agent.docker_image", settings.docker_image, "an image on that engine")
    for mount in settings.docker_mounts:
        source, sep, target = mount.partition(":")
        if not (sep and source.startswith("/") and target.startswith("/")):
            raise ConfigError("agent.docker_mounts", mount, "SRC:DST[:ro], both absolute paths")


def docker_backend(host: HostId, settings: AgentSettings, work: Path) -> DockerBackend:
    """The backend that starts ``host``'s replica containers, ``work`` mounted in each."""
    from nbos.backends.docker import DockerBackend

    return DockerBackend(
        {host: settings.docker_engine},
        image=settings.docker_image,
        mounts=[*settings.docker_mounts, f"{work}:{work}"],
        network_mode="host",
        # The agent's user: the replica's files in STATE/work stay the agent's.
        user=f"{os.getuid()}:{os.getgid()}",
    )


def container_env(spec_env: Mapping[str, str]) -> dict[str, str]:
    """A replica container's environment: what the agent's processes would inherit of
    nbos, then the spec's own."""
    inherited = {
        k: v for k, v in os.environ.items() if k.startswith(_INHERITED_PREFIX) or k in _INHERITED
    }
    return {**inherited, **spec_env}


def replica_labels(replica_id: str, spec: ReplicaSpec) -> dict[str, str]:
    """The labels of a replica's container besides its host's: the replica, its kernel."""
    kernel = spec.owner.kernel_id if spec.owner is not None else spec.workdir.partition("/")[0]
    return {"nbos.replica": replica_id, "nbos.kernel": kernel}
