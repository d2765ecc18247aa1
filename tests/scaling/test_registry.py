"""Loading policies by name through the ``nbos.placement_policies`` entry points."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.core.errors import PluginError
from nbos.scaling import (
    BinPackingPolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    available_policies,
    load_policy,
)

from .conftest import cluster, host, request


def test_builtins_are_registered() -> None:
    assert {"least-loaded", "bin-packing", "random"} <= set(available_policies())
    assert isinstance(load_policy("least-loaded"), LeastLoadedPolicy)
    assert isinstance(load_policy("bin-packing"), BinPackingPolicy)
    assert isinstance(load_policy("random", seed=5), RandomPolicy)


def test_kwargs_reach_the_policy() -> None:
    view = cluster(*(host(f"h{i}") for i in range(9)))
    a, b = load_policy("random", seed=11), load_policy("random", seed=11)
    assert [a.place(request(), view) for _ in range(5)] == [
        b.place(request(), view) for _ in range(5)
    ]


def test_unknown_name_lists_known_policies() -> None:
    with pytest.raises(PluginError) as err:
        load_policy("no-such-policy")
    assert "least-loaded" in err.value.known
    assert "least-loaded" in str(err.value)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(PluginError, match="refused the options"):
        load_policy("least-loaded", seed=1)


@pytest.fixture
def odd_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path whose entry points are broken in the ways a user's can be."""
    dist = tmp_path / "odd_policies-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: odd-policies\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[nbos.placement_policies]\n"
        "broken = nbos_no_such_module:Policy\n"
        "not-a-policy = builtins:dict\n"
        "bin-packing = nbos.scaling.policies:LeastLoadedPolicy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("odd_entry_points")
def test_broken_entry_points_are_refused() -> None:
    with pytest.raises(PluginError, match="failed to import"):
        load_policy("broken")
    with pytest.raises(PluginError, match=r"not a nbos\.core\.placement\.PlacementPolicy"):
        load_policy("not-a-policy")
    with pytest.raises(PluginError, match=r"by 2 distributions: nbos .* and odd-policies 0\.1"):
        load_policy("bin-packing")
    assert isinstance(load_policy("least-loaded"), LeastLoadedPolicy)
