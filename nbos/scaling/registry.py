"""Placement policies by name, from the entry point group ``nbos.placement_policies``.

An entry point names a class (or any factory) that, called with the keyword
arguments given to :func:`load_policy`, returns a
:class:`~nbos.core.placement.PlacementPolicy`. nbos registers its built-ins the
same way, so a user's package adds a policy by declaring one in its own metadata.
"""

from __future__ import annotations

from typing import Any

from nbos.core.placement import PlacementPolicy
from nbos.core.plugins import PluginGroup

GROUP = "nbos.placement_policies"

_POLICIES = PluginGroup[PlacementPolicy](GROUP, PlacementPolicy)


def available_policies() -> list[str]:
    """Names of the registered policies, sorted."""
    return _POLICIES.names()


def load_policy(name: str, /, **kwargs: Any) -> PlacementPolicy:
    """The policy registered as ``name``, built with ``kwargs``.

    Raises :class:`~nbos.core.errors.PluginError` (``known`` lists the registered
    names) for an unknown name, a name two packages register, an entry point that
    cannot be imported, arguments it refuses, or something that is not a
    ``PlacementPolicy``.
    """
    return _POLICIES.make(name, **kwargs)
