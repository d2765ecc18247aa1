"""Which names of a user namespace are user state, and which are IPython's bookkeeping."""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Iterator, Mapping

# IPython and the interpreter put these in user_ns; each replica has its own and they
# must neither travel nor count in a digest.
_BOOKKEEPING = frozenset(
    {"_", "__", "___", "_oh", "_ih", "_dh", "_sh", "In", "Out", "get_ipython", "exit", "quit"}
)
# _i, _ii, _iii, _i<N> (input history) and _<N> (output history); a user's `_items` is state.
_HISTORY = re.compile(r"_i{1,3}|_i\d+|_\d+")


# Every cell scans every name, and IPython adds an ``_i<N>`` per cell that is never
# removed: the regex on each would cost more per cell the longer a kernel lives.
@functools.lru_cache(maxsize=1 << 16)
def is_user_name(name: str) -> bool:
    """Whether ``name`` in a user namespace holds user state that replicas must share."""
    if name in _BOOKKEEPING or _HISTORY.fullmatch(name):
        return False
    return not (name.startswith("__") and name.endswith("__"))


def user_items(namespace: Mapping[str, object]) -> Iterator[tuple[str, object]]:
    """The user-state entries of ``namespace``, in its order.

    Besides bookkeeping names, this leaves out IPython's own ``open`` (a wrapper of
    ``io.open`` it puts in every user namespace); an ``open`` the user binds is state.
    """
    for name, value in namespace.items():
        if is_user_name(name) and not (name == "open" and _is_ipython_open(value)):
            yield name, value


class UserState:
    """The user state of one namespace, looked up after every cell.

    IPython adds an ``_i<N>`` to a user namespace per cell and never removes it: checked
    name by name in Python, they made every cell cost more the longer its kernel lived
    (1.5 ms per cell after 5,000 cells; 142 µs with names classified once and skipped
    as a set). Here a name is classified once, when first seen, and a look finds new
    names without going over the others in Python: those bound since the last look come
    last in the namespace's order, and a set comparison (in C) catches the rare one that
    does not (a name deleted and bound again after it). Then only the names that may be
    user state are looked up, in the order they were first seen (since their last
    deletion).
    """

    def __init__(self) -> None:
        #: The namespace's names as of the last look, and bookkeeping names seen before.
        self._seen: set[str] = set()
        #: Those of them that may be user state, in the order first seen.
        self._names: dict[str, None] = {}

    def of(self, namespace: dict[str, object], hidden: Mapping[str, object]) -> dict[str, object]:
        """The entries of ``namespace`` that may be user state: not IPython's
        bookkeeping, nor what ``hidden`` holds (IPython's ``user_ns_hidden``: helpers it
        seeds each namespace with) unless the user rebound the name.
        :func:`user_items` of the result is the user state."""
        self._notice(namespace)
        found: dict[str, object] = {}
        gone = []
        for name in self._names:
            value = namespace.get(name, _ABSENT)
            if value is _ABSENT:
                gone.append(name)
            elif name not in hidden or hidden[name] is not value:
                found[name] = value
        for name in gone:  # so that it is noticed when bound again
            del self._names[name]
            self._seen.discard(name)
        return found

    def _notice(self, namespace: dict[str, object]) -> None:
        seen = self._seen
        fresh = []
        for name in reversed(namespace):
            if name in seen:
                break
            fresh.append(name)
        for name in reversed(fresh):
            self._see(name)
        if not seen.issuperset(namespace):
            for name in namespace:
                if name not in seen:
                    self._see(name)

    def _see(self, name: str) -> None:
        self._seen.add(name)
        if is_user_name(name):
            self._names[name] = None


_ABSENT = object()


def _is_ipython_open(value: object) -> bool:
    return value is not io.open and getattr(value, "__wrapped__", None) is io.open
