"""Loading policies by name through the ``nbos.placement_policies`` entry points."""

from __future__ import annotations

import pytest

from nbos.core.errors import PlacementError, UnknownPolicyError
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
    with pytest.raises(UnknownPolicyError) as err:
        load_policy("no-such-policy")
    assert "least-loaded" in err.value.known
    assert "least-loaded" in str(err.value)


def test_bad_arguments_are_a_placement_error() -> None:
    with pytest.raises(PlacementError, match="refused its arguments"):
        load_policy("least-loaded", seed=1)
