"""Fixtures for the backend tests: real sshd and dockerd, and one ``Case`` per backend."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nbos.backends import LocalProcessBackend
from nbos.core.compute_backend import ComputeBackend, ProcessHandle, ProcessSpec
from nbos.core.ids import HostId
from tests._servers._process import serve_or_skip
from tests._servers.dockerd import DockerDaemon, docker_mounts
from tests._servers.sshd import SshServer, start_sshd
from tests.backends._procs import MARKER_ENV
from tests.backends._ssh import ssh_target

HOSTS = (HostId("h1"), HostId("h2"))


@pytest.fixture
def anyio_backend() -> str:
    # aiodocker and asyncssh run on asyncio only.
    return "asyncio"


@pytest.fixture(scope="session")
def sshd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    yield from serve_or_skip(lambda: start_sshd(tmp_path_factory.mktemp("sshd")), "a real sshd")


@dataclass
class Case:
    """A backend under test, its hosts, and a directory its processes can write to."""

    kind: str
    backend: ComputeBackend
    workdir: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def host(self) -> HostId:
        return HOSTS[0]

    def spec(self, argv: list[str], **env: str) -> ProcessSpec:
        return ProcessSpec(argv=argv, env={MARKER_ENV: self.marker, **env}, label="test")

    async def start(self, argv: list[str], host: HostId | None = None, **env: str) -> ProcessHandle:
        return await self.backend.start(host or self.host, self.spec(argv, **env))


def make_backend(kind: str, request: pytest.FixtureRequest, workdir: Path) -> ComputeBackend:
    if kind == "local":
        return LocalProcessBackend(HOSTS, run_dir=workdir / "run")
    if kind == "docker":
        from nbos.backends.docker import DockerBackend

        daemon: DockerDaemon = request.getfixturevalue("docker_daemon")
        image: str = request.getfixturevalue("docker_image")
        return DockerBackend(
            {h: daemon.url for h in HOSTS}, image=image, mounts=docker_mounts(workdir)
        )
    from nbos.backends.ssh import SshBackend

    server: SshServer = request.getfixturevalue("sshd_server")
    target = ssh_target(server)
    return SshBackend({h: target for h in HOSTS}, remote_log_dir=str(workdir / "remote-logs"))


@pytest.fixture(params=["local", "docker", "ssh"])
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Case]:
    made = Case(request.param, make_backend(request.param, request, tmp_path), tmp_path)
    try:
        yield made
    finally:
        await made.backend.aclose()
