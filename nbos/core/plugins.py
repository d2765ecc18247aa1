"""The one plug-in loader: entry points of the ``nbos.*`` groups, checked against their Protocol.

A user's package adds a placement policy, a compute backend, an object store or a host
provider by declaring an entry point in its own metadata; nbos registers its built-ins
the same way. Every group follows the same rules, each breach a
:class:`~nbos.core.errors.PluginError` naming the group, the name and the cause, with a
log line:

* an unknown name is refused, listing the registered ones;
* a name that two distributions register is refused, naming both: taking either would
  make what runs depend on the order packages were installed in;
* an entry point whose import fails, a factory that refuses its options, and an object
  that does not satisfy the group's Protocol are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar, cast

from nbos.core.errors import PluginError

log = logging.getLogger(__name__)

T = TypeVar("T")


class PluginGroup(Generic[T]):
    """The entry point group ``group``, whose plug-ins are (or make) a ``kind``.

    ``kind`` is a runtime-checkable Protocol; declare a group with the type it checks,
    ``PluginGroup[ComputeBackend]("nbos.backends", ComputeBackend)`` (``kind`` is a plain
    ``type`` because mypy accepts no Protocol where ``type[T]`` is expected). A group's
    entry points either name the plug-in itself (:meth:`load`) or a factory that makes
    it (:meth:`make`); its documentation says which.
    """

    def __init__(self, group: str, kind: type) -> None:
        self.group = group
        self.kind = kind

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted({ep.name for ep in entry_points(group=self.group)})

    def load(self, name: str) -> T:
        """The object the entry point ``name`` names; it must be a ``kind``."""
        return self._checked(name, self._import(name))

    def make(self, name: str, /, **options: Any) -> T:
        """What the factory the entry point ``name`` names makes of ``options``; a ``kind``.

        ``name`` is positional only, so that a plug-in may take a ``name`` option. A
        ``TypeError`` from the call is taken for options the factory does not take;
        any other error it raises (a ``ConfigError`` naming its own setting) is the
        caller's as it is.
        """
        factory = self._import(name)
        if not callable(factory):
            raise self._refused(name, f"{_described(factory)} is not callable")
        try:
            made = factory(**options)
        except TypeError as exc:
            raise self._refused(name, f"refused the options {sorted(options)}: {exc}") from exc
        return self._checked(name, made)

    def _entry_point(self, name: str) -> EntryPoint:
        found = list(entry_points(group=self.group, name=name))
        if not found:
            known = self.names()
            raise self._refused(name, f"unknown; known: {', '.join(known) or 'none'}", known)
        if len(found) > 1:
            registrations = " and ".join(sorted(_origin(ep) for ep in found))
            raise self._refused(name, f"registered by {len(found)} distributions: {registrations}")
        return found[0]

    def _import(self, name: str) -> object:
        entry = self._entry_point(name)
        try:
            loaded: object = entry.load()
        except Exception as exc:  # whatever importing someone's module raises
            cause = f"{entry.value} failed to import ({type(exc).__name__}: {exc})"
            raise self._refused(name, cause) from exc
        return loaded

    def _checked(self, name: str, plugin: object) -> T:
        if not isinstance(plugin, self.kind):
            expected = f"{self.kind.__module__}.{self.kind.__qualname__}"
            raise self._refused(name, f"gave {_described(plugin)}, not a {expected}")
        return cast(T, plugin)  # isinstance cannot narrow to T: kind is a plain type

    def _refused(self, name: str, cause: str, known: Sequence[str] = ()) -> PluginError:
        log.warning("plug-in %r of entry point group %r refused: %s", name, self.group, cause)
        return PluginError(self.group, name, cause, known)


def _origin(entry: EntryPoint) -> str:
    dist = entry.dist
    where = f"{dist.name} {dist.version}" if dist is not None else "an unnamed distribution"
    return f"{where} ({entry.value})"


def _described(thing: object) -> str:
    if isinstance(thing, type):
        return f"the class {thing.__module__}.{thing.__qualname__}"
    return f"a {type(thing).__qualname__}"
