"""Patching a held buffer in place when only the values a delta replaces reach it.

A replica applying a patch of a large buffer builds the new version on the version it
holds. Copying that first costs a pass over all of its bytes on every replica, every
cell: 500 MB of memory copied per follower for one element written, CPU that the
executor's next Raft round then waits for. When the only way to reach the held buffer
is a value the same delta replaces, nothing sees its old bytes after the apply, so the
patch is written over them instead.

"Only way" is decided by reference counts, so it errs towards copying: the buffer must
have one referrer, and following it back must lead, one sole reference at a time, to
the namespace entry of a replaced name (a numpy array over the buffer, its base array,
the memoryview between them). Another name, a view, a list or a cache that holds any
link makes the count higher and the buffer is copied as before.

A failed apply must leave the namespace as it was: the bytes each patch overwrites are
kept until the apply is done, and :meth:`InPlace.undo` writes them back.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping

#: Links at most from a namespace value to its buffer (array, base array, memoryview).
_MAX_LINKS = 8


class InPlace:
    """The buffers one apply patches in place, and the bytes it wrote over."""

    def __init__(self, namespace: Mapping[str, object], replaced: Collection[str]) -> None:
        self._namespace = namespace
        self._replaced = replaced
        self._taken: dict[int, bytearray] = {}
        self._saved: list[tuple[bytearray, int, bytes]] = []
        #: the replaced names whose old values gave up their buffers
        self.relied_on: set[str] = set()

    def reached_only_by_replaced(self, buffer: bytearray) -> bool:
        """Whether the one referrer of ``buffer`` hangs off a replaced name alone."""
        for name in self._replaced:
            if _sole_path(self._namespace, name, buffer):
                self.relied_on.add(name)
                return True
        return False

    def take(self, buffer: bytearray) -> None:
        """``buffer`` is patched in place from now on."""
        self._taken[id(buffer)] = buffer

    def took(self, buffer: bytearray) -> bool:
        return self._taken.get(id(buffer)) is buffer

    def write(self, buffer: bytearray, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset``, keeping what it overwrites if ``buffer`` was taken."""
        end = offset + len(data)
        if self.took(buffer):
            self._saved.append((buffer, offset, bytes(buffer[offset:end])))
        buffer[offset:end] = data

    def undo(self) -> None:
        """Put back every byte written over, newest write first."""
        for buffer, offset, old in reversed(self._saved):
            buffer[offset : offset + len(old)] = old
        self._saved.clear()


def _sole_path(namespace: Mapping[str, object], name: str, buffer: bytearray) -> bool:
    link = namespace.get(name)
    for _ in range(_MAX_LINKS):
        if link is buffer:
            return True
        # One holder (the namespace, or the previous link), `link` here, the argument.
        if link is None or sys.getrefcount(link) != 3:
            return False
        link = _referent(link)
    return False


def _referent(link: object) -> object:
    """What ``link`` keeps its bytes in: a memoryview's exporter, a numpy array's base."""
    if isinstance(link, memoryview):
        return link.obj
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(link, numpy.ndarray):
        return link.base
    return None
