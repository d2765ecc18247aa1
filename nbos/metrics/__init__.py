"""What the cluster does, counted in one place, for the gateway's Prometheus endpoint.

Library code (the kernel front, the executor chooser, replacement) reports
events to :func:`events`, which is a no-op until a gateway that serves metrics
installs a real sink (:func:`installed`): nothing below the gateway depends on
``prometheus_client``, and a process without a metrics endpoint pays one method
call per event. One sink per process, as there is one gateway per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

#: Why a replica was started in place of another: a dead one, or a move to free GPUs.
MoveKind = Literal["replacement", "migration"]


class Events(Protocol):
    """Where events go; every method returns at once and never raises."""

    def cell_waited(self, seconds: float) -> None:
        """A cell got its executor and GPUs ``seconds`` after it asked for them."""

    def cell_ran(self, seconds: float) -> None:
        """A cell held its executor (and GPUs) for ``seconds``."""

    def replica_moved(self, kind: MoveKind) -> None:
        """A new replica took a kernel's member's place (``kind`` says why)."""

    def message_refused(self) -> None:
        """A client message was refused (unsigned, wrongly signed, malformed)."""


class NoEvents:
    """The default sink: drops everything."""

    def cell_waited(self, seconds: float) -> None:
        pass

    def cell_ran(self, seconds: float) -> None:
        pass

    def replica_moved(self, kind: MoveKind) -> None:
        pass

    def message_refused(self) -> None:
        pass


_sink: Events = NoEvents()


def events() -> Events:
    """The sink of this process."""
    return _sink


@contextmanager
def installed(sink: Events) -> Iterator[Events]:
    """Make ``sink`` this process's sink for the block (the one before it afterwards)."""
    global _sink  # noqa: PLW0603 (the one process-wide sink, by design)
    before, _sink = _sink, sink
    try:
        yield sink
    finally:
        _sink = before
