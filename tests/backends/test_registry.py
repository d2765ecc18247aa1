"""open_backend: finding backends through the ``nbos.backends`` entry point group."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.backends import ENTRY_POINT_GROUP, LocalProcessBackend, backend_names, open_backend
from nbos.core.errors import BackendError, ConfigError

pytestmark = pytest.mark.anyio

BUILTIN = {
    "local": "nbos.backends.local:LocalProcessBackend",
    "docker": "nbos.backends.docker:DockerBackend",
    "ssh": "nbos.backends.ssh:SshBackend",
}


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path declaring the built-in backends and a broken one."""
    dist = tmp_path / "nbos_test_backends-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nbos-test-backends\nVersion: 0\n")
    lines = [f"{name} = {target}" for name, target in BUILTIN.items()]
    lines.append("broken = nbos_no_such_module:Backend")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("registered")
async def test_open_backend_by_name(tmp_path: Path) -> None:
    assert {"local", "docker", "ssh", "broken"} <= set(backend_names())
    backend = open_backend("local", hosts=["h1", "h2"], run_dir=tmp_path)
    assert isinstance(backend, LocalProcessBackend)
    assert backend.hosts() == ("h1", "h2")
    await backend.aclose()
    ssh = open_backend("ssh", hosts={"h1": {"address": "127.0.0.1"}})
    assert ssh.name == "ssh"
    docker = open_backend("docker", hosts={"h1": "unix:///nowhere.sock"}, image="i")
    assert docker.name == "docker"


@pytest.mark.usefixtures("registered")
def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="local") as info:
        open_backend("kubernetes")
    assert info.value.value == "kubernetes"


@pytest.mark.usefixtures("registered")
def test_options_the_backend_does_not_take_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="colour"):
        open_backend("local", hosts=["h1"], colour="blue")


@pytest.mark.usefixtures("registered")
def test_a_backend_that_cannot_be_imported_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="broken"):
        open_backend("broken")


def test_the_installed_package_registers_the_builtin_backends() -> None:
    missing = set(BUILTIN) - set(backend_names())
    if missing == set(BUILTIN):
        pytest.skip("pyproject.toml does not declare the nbos.backends entry points yet")
    assert not missing
