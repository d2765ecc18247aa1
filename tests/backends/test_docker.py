"""Docker-specific behaviour: engine errors, image errors, container cleanup, config."""

from __future__ import annotations

import json
import signal
import urllib.parse
from pathlib import Path

import aiodocker
import pytest

from nbos.backends.docker import BACKEND_LABEL, DockerBackend, _already_in_state
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError, ConfigError, HostUnreachableError
from nbos.core.ids import HostId
from tests._servers.dockerd import DockerDaemon, docker_mounts
from tests.backends._procs import EXIT_3, SLEEP, python

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

H1 = HostId("h1")


def containers_of(daemon: DockerDaemon, backend: DockerBackend) -> list[dict[str, object]]:
    filters = urllib.parse.quote(json.dumps({"label": [f"{BACKEND_LABEL}={backend.instance}"]}))
    status, body = daemon.request("GET", f"/containers/json?all=1&filters={filters}")
    assert status == 200
    listed: list[dict[str, object]] = json.loads(body)
    return listed


async def test_unreachable_engine(tmp_path: Path) -> None:
    backend = DockerBackend({H1: f"unix://{tmp_path}/no-docker.sock"}, image="any")
    with pytest.raises(HostUnreachableError) as info:
        await backend.start(H1, ProcessSpec(["/bin/true"]))
    assert info.value.host == H1
    await backend.aclose()


async def test_missing_image_is_a_backend_error(docker_daemon: DockerDaemon) -> None:
    backend = DockerBackend({H1: docker_daemon.url}, image="nbos-no-such-image:1")
    with pytest.raises(BackendError, match="nbos-no-such-image") as info:
        await backend.start(H1, ProcessSpec(["/bin/true"]))
    assert not isinstance(info.value, HostUnreachableError)
    assert containers_of(docker_daemon, backend) == []
    await backend.aclose()


async def test_aclose_removes_every_container_it_made(
    docker_daemon: DockerDaemon, docker_image: str
) -> None:
    backend = DockerBackend({H1: docker_daemon.url}, image=docker_image, mounts=docker_mounts())
    exited = await backend.start(H1, ProcessSpec(python(EXIT_3), label="exits"))
    await backend.start(H1, ProcessSpec(python(SLEEP), label="sleeps"))
    assert await exited.wait() == 3
    labels = sorted(str(c["Labels"]["nbos.label"]) for c in containers_of(docker_daemon, backend))  # type: ignore[index]
    assert labels == ["exits", "sleeps"]
    await backend.aclose()
    assert containers_of(docker_daemon, backend) == []


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        DockerBackend({}, image="x")
    with pytest.raises(ConfigError):
        DockerBackend({"h": ""}, image="x")
    with pytest.raises(ConfigError, match="unix"):
        DockerBackend({"h": "docker-host-1"}, image="x")
    with pytest.raises(ConfigError):
        DockerBackend({"h": "unix:///var/run/docker.sock"}, image="")


@pytest.mark.parametrize(
    ("message", "already"),
    [
        ("Container abc is not paused", True),
        ("Cannot unpause container abc: cannot resume a running process: unknown", True),
        ("Cannot unpause container abc: permission denied", False),
    ],
)
def test_an_unpause_refused_because_the_process_runs_is_nothing_to_do(
    message: str, already: bool
) -> None:
    """SIGCONT asks for a running process; the engine's or runc's word that it runs is
    success (runc's refusal was seen under a CPU hog, with the engine listing it paused)."""
    error = aiodocker.DockerError(500, {"message": message})
    assert _already_in_state(error, signal.SIGCONT) is already
    assert not _already_in_state(error, signal.SIGTERM)
