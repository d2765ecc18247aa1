"""What a tracker of page writes promises (soft-dirty bits or userfaultfd), and who may
rely on its bits between clears: the two sides of :mod:`._pages` and :mod:`._uffd`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Span = tuple[int, int]  # [start, end) of addresses (page-aligned for tracked spans)


class Watcher(Protocol):
    """Something that trusts page bits between clears (a :class:`BufferKeys`)."""

    def before_clear(self, pages: PageWrites) -> None:
        """Read the bits you rely on now: they are about to be cleared."""
        ...


class PageWrites(Protocol):
    """Tells whether memory was written since the last :meth:`clear`.

    The bits are process-wide, so every clear must first let each watcher read
    what it relies on: then no clear, by whichever capture, loses a write.
    """

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher.before_clear`` before every clear, while ``watcher`` lives."""
        ...

    def track(self, address: int, nbytes: int, owner: Callable[[], object]) -> bool:
        """Make sure writes to ``[address, address + nbytes)`` from now on are seen, while
        ``owner()`` lives; ``False`` if they cannot be (the range then always reads as
        written). Call it before reading bytes that :meth:`written` will vouch for."""
        ...

    def clear(self) -> None:
        """Start a new interval: every page counts as unwritten from now on."""
        ...

    def written(self, address: int, nbytes: int) -> bool:
        """Whether any byte of ``[address, address + nbytes)`` may have been written."""
        ...

    def written_spans(self, address: int, nbytes: int) -> list[Span] | None:
        """The written parts of ``[address, address + nbytes)``, whole pages clipped to
        the range, sorted and disjoint; ``None`` if this tracker cannot tell."""
        ...
