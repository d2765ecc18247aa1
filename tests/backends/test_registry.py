"""open_backend: finding backends through the ``nbos.backends`` entry point group."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.backends import ENTRY_POINT_GROUP, LocalProcessBackend, backend_names, open_backend
from nbos.core.errors import PluginError

pytestmark = pytest.mark.anyio

BUILTIN = {"local", "docker", "ssh"}


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path declaring a backend that cannot be imported."""
    dist = tmp_path / "nbos_test_backends-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nbos-test-backends\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nbroken = nbos_no_such_module:Backend\n"
    )
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
    with pytest.raises(PluginError, match="local") as info:
        open_backend("kubernetes")
    assert (info.value.group, info.value.name) == (ENTRY_POINT_GROUP, "kubernetes")
    assert {"local", "docker", "ssh", "broken"} <= set(info.value.known)


@pytest.mark.usefixtures("registered")
def test_options_the_backend_does_not_take_are_refused() -> None:
    with pytest.raises(PluginError, match="colour"):
        open_backend("local", hosts=["h1"], colour="blue")


@pytest.mark.usefixtures("registered")
def test_a_backend_that_cannot_be_imported_is_refused_with_the_cause() -> None:
    with pytest.raises(PluginError, match="nbos_no_such_module") as info:
        open_backend("broken")
    assert isinstance(info.value.__cause__, ImportError)


def test_the_installed_package_registers_the_builtin_backends() -> None:
    assert set(backend_names()) >= BUILTIN
