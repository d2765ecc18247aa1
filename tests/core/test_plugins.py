"""The one plug-in loader, over real distributions: ``*.dist-info`` directories on sys.path."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import pytest

from nbos.core.errors import ConfigError, PluginError
from nbos.core.plugins import PluginGroup

GROUP = "nbos.test_greeters"

GREETERS = """
class English:
    def __init__(self, name="world"):
        self.name = name

    def greet(self):
        return f"hello {self.name}"


ENGLISH = English()


class Mute:
    pass
"""

_modules = itertools.count()


@runtime_checkable
class Greeter(Protocol):
    def greet(self) -> str: ...


GREETER = PluginGroup[Greeter](GROUP, Greeter)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path, for distributions and their modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def install(site: Path, distribution: str, entries: dict[str, str], source: str = "") -> str:
    """Install ``distribution`` into ``site``, registering ``entries`` (name to ``:ATTR``,
    an attribute of a module of ``source`` or, when a whole ``module:attr``, as it is)."""
    module = f"nbos_test_greeters_{next(_modules)}"  # sys.modules keeps each one imported
    (site / f"{module}.py").write_text(source)
    dist = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    lines = [
        f"{n} = {module}{t}" if t.startswith(":") else f"{n} = {t}" for n, t in entries.items()
    ]
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\n" + "\n".join(lines) + "\n")
    return module


def test_a_registered_name_loads_or_makes_its_plugin(site: Path) -> None:
    install(site, "greeters", {"hello": ":English", "hello-object": ":ENGLISH"}, GREETERS)
    assert GREETER.names() == ["hello", "hello-object"]
    assert GREETER.make("hello", name="nbos").greet() == "hello nbos"
    assert GREETER.load("hello-object").greet() == "hello world"


def test_an_unknown_name_is_refused_listing_the_known_ones(
    site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install(site, "greeters", {"hello": ":English"}, GREETERS)
    with pytest.raises(PluginError, match="known: hello") as info:
        GREETER.make("bonjour")
    error = info.value
    assert (error.group, error.name, error.known) == (GROUP, "bonjour", ["hello"])
    assert isinstance(error, ConfigError)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "bonjour" in caplog.records[0].getMessage()


def test_a_name_two_distributions_register_is_refused_naming_both(site: Path) -> None:
    first = install(site, "greeters-a", {"hello": ":English"}, GREETERS)
    second = install(site, "greeters-b", {"hello": ":English"}, GREETERS)
    with pytest.raises(PluginError) as info:
        GREETER.make("hello")
    assert info.value.cause == (
        f"registered by 2 distributions: greeters-a 1.0 ({first}:English)"
        f" and greeters-b 1.0 ({second}:English)"
    )


@pytest.mark.parametrize(
    ("target", "source", "cause"),
    [
        ("nbos_no_such_module:Greeter", "", "ModuleNotFoundError: No module named"),
        (":English", "raise RuntimeError('no greetings today')", "RuntimeError: no greetings"),
        (":French", GREETERS, "AttributeError"),
    ],
)
def test_an_entry_point_that_fails_to_import_is_refused_with_the_cause(
    site: Path, target: str, source: str, cause: str
) -> None:
    install(site, "greeters", {"hello": target}, source)
    with pytest.raises(PluginError, match="failed to import") as info:
        GREETER.make("hello")
    assert cause in info.value.cause
    assert info.value.__cause__ is not None


def test_an_object_not_satisfying_the_protocol_is_refused(site: Path) -> None:
    install(site, "greeters", {"mute": ":Mute"}, GREETERS)
    expected = f"not a {__name__}.Greeter"
    with pytest.raises(PluginError, match="gave a Mute") as info:
        GREETER.make("mute")
    assert info.value.cause.endswith(expected)
    with pytest.raises(PluginError, match=r"gave the class nbos_test_greeters_\d+\.Mute") as info:
        GREETER.load("mute")
    assert info.value.cause.endswith(expected)


def test_options_the_factory_does_not_take_are_refused(site: Path) -> None:
    install(site, "greeters", {"hello": ":English", "object": ":ENGLISH"}, GREETERS)
    with pytest.raises(PluginError, match=r"refused the options \['colour'\]"):
        GREETER.make("hello", colour="blue")
    with pytest.raises(PluginError, match="a English is not callable"):
        GREETER.make("object")
