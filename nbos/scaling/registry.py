"""Placement policies by name, from the entry point group ``nbos.placement_policies``.

An entry point names a class (or any factory) that, called with the keyword
arguments given to :func:`load_policy`, returns a
:class:`~nbos.core.placement.PlacementPolicy`. nbos registers its built-ins the
same way, so a user's package adds a policy by declaring one in its own metadata.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from nbos.core.errors import PlacementError, UnknownPolicyError
from nbos.core.placement import PlacementPolicy

log = logging.getLogger(__name__)

GROUP = "nbos.placement_policies"


def available_policies() -> list[str]:
    """Names of the registered policies, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load_policy(name: str, **kwargs: Any) -> PlacementPolicy:
    """The policy registered as ``name``, built with ``kwargs``.

    Raises :class:`UnknownPolicyError` (listing the known names) if none is
    registered, and :class:`PlacementError` if the entry point cannot be loaded,
    refuses the arguments or does not produce a ``PlacementPolicy``.
    """
    found = entry_points(group=GROUP, name=name)
    if not found:
        log.info("unknown placement policy %r requested", name)
        raise UnknownPolicyError(name, available_policies())
    entry = _single(name, list(found))
    try:
        factory = entry.load()
    except Exception as exc:
        log.warning("placement policy %r (%s) failed to load: %s", name, entry.value, exc)
        raise PlacementError(f"placement policy {name!r} ({entry.value}) failed to load") from exc
    try:
        policy = factory(**kwargs)
    except Exception as exc:
        log.warning("placement policy %r refused arguments %s: %s", name, sorted(kwargs), exc)
        raise PlacementError(f"placement policy {name!r} refused its arguments: {exc}") from exc
    if not isinstance(policy, PlacementPolicy):
        message = (
            f"entry point {name!r} ({entry.value}) gave {type(policy).__name__}, "
            "not a PlacementPolicy (needs name, place and migration_target)"
        )
        log.warning("%s", message)
        raise PlacementError(message)
    return policy


def _single(name: str, found: list[EntryPoint]) -> EntryPoint:
    # Two distributions may declare the same name; silently taking either would make
    # the cluster's behaviour depend on install order.
    targets = sorted({ep.value for ep in found})
    if len(targets) > 1:
        log.warning("placement policy %r is registered twice: %s", name, targets)
        raise PlacementError(f"placement policy {name!r} is registered twice: {targets}")
    return found[0]
