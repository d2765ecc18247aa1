"""A policy from another package, registered through a real entry point, is loaded by name.

The example package in ``examples/placement_policy`` is built and installed by pip
into a temporary target directory (so the shared environment is left as it was),
which is then put on ``sys.path``: ``importlib.metadata`` finds its dist-info and
entry point exactly as it would in site-packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nbos.core.ids import HostId, KernelId
from nbos.core.placement import PlacementPolicy, PlacementRequest
from nbos.scaling import available_policies, load_policy

from .conftest import cluster, host


def test_user_policy_is_found_by_name_and_places_replicas(
    installed_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(installed_policy))
    assert "spread-by-name" in available_policies()
    policy = load_policy("spread-by-name", salt="x")
    assert isinstance(policy, PlacementPolicy)
    assert policy.name == "spread-by-name"
    # It came from the package pip just installed, not from the source tree.
    module = sys.modules[type(policy).__module__]
    assert Path(str(module.__file__)).is_relative_to(installed_policy)

    view = cluster(*(host(f"h{i}") for i in range(6)), host("off", schedulable=False))
    req = PlacementRequest(KernelId("k-42"), 1, 3, frozenset({HostId("h2")}))
    chosen = policy.place(req, view)
    assert len(set(chosen)) == 3
    assert set(chosen).isdisjoint({HostId("h2"), HostId("off")})
    assert policy.place(req, view) == chosen  # stable for one kernel id
    others = {tuple(policy.place(PlacementRequest(KernelId(f"k-{i}"), 1), view)) for i in range(8)}
    assert len(others) > 1  # and spread across kernels
