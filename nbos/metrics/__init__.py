"""What the cluster does, counted in one place, for the gateway's Prometheus endpoint and
its dashboard.

Library code (the kernel front, the executor chooser, replacement, the host directory,
the autoscaler, the endpoints that refuse requests) reports events to :func:`events`,
which is a no-op until a gateway installs a real sink (:func:`installed`): nothing below
the gateway depends on ``prometheus_client``, and a process without a gateway pays one
method call per event. One sink per process, as there is one gateway per process; a
gateway that both counts (Prometheus) and shows (its dashboard's event log) installs a
:class:`Fanout` of the two.

What an operator reads in an event log (a replica replaced or migrated, a host suspected,
back or gone, a scale-out or scale-in, a refused request) is one :class:`ClusterEvent`,
reported with :meth:`Events.happened` where it happens, next to its log line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, Protocol, TypeVar

import attrs

#: What a :class:`ClusterEvent` is about.
EventKind = Literal[
    "replacement",
    "migration",
    "scale-out",
    "scale-in",
    "host-joined",
    "host-suspected",
    "host-returned",
    "host-left",
    "refused",
]


@attrs.frozen
class ClusterEvent:
    """One thing that happened to the cluster, told in one line (``text``).

    ``kernel``: the kernel it concerns (its gateway id; ``""``: none), which only its owner
    and admins may learn of; ``host``: the host it concerns (``""``: none). A ``refused``
    event (a request turned away: no or a wrong token, an overloaded or full cluster)
    names whoever asked, and is the admins' only.
    """

    kind: EventKind
    text: str
    kernel: str = ""
    host: str = ""
    #: Wall-clock seconds (``time.time()``) when it happened.
    time: float = attrs.field(factory=time.time)


class Events(Protocol):
    """Where events go; every method returns at once and never raises."""

    def cell_waited(self, seconds: float) -> None:
        """A cell got its executor and GPUs ``seconds`` after it asked for them."""

    def cell_ran(self, seconds: float) -> None:
        """A cell held its executor (and GPUs) for ``seconds``."""

    def cell_delayed(self, cause: str, seconds: float) -> None:
        """A cell that started waited ``seconds`` for ``cause`` (one of
        ``nbos.scaling.delays.CAUSES``: queue, gpus, migration, scale_out, overhead)."""

    def message_refused(self) -> None:
        """A client message was refused (unsigned, wrongly signed, malformed)."""

    def happened(self, event: ClusterEvent) -> None:
        """Something for the cluster's event log happened (see :class:`ClusterEvent`)."""


class NoEvents:
    """The default sink: drops everything."""

    def cell_waited(self, seconds: float) -> None:
        pass

    def cell_ran(self, seconds: float) -> None:
        pass

    def cell_delayed(self, cause: str, seconds: float) -> None:
        pass

    def message_refused(self) -> None:
        pass

    def happened(self, event: ClusterEvent) -> None:
        pass


class Fanout:
    """A sink that passes every event to each of ``sinks``, in order."""

    def __init__(self, sinks: Sequence[Events]) -> None:
        self.sinks = tuple(sinks)

    def cell_waited(self, seconds: float) -> None:
        for sink in self.sinks:
            sink.cell_waited(seconds)

    def cell_ran(self, seconds: float) -> None:
        for sink in self.sinks:
            sink.cell_ran(seconds)

    def cell_delayed(self, cause: str, seconds: float) -> None:
        for sink in self.sinks:
            sink.cell_delayed(cause, seconds)

    def message_refused(self) -> None:
        for sink in self.sinks:
            sink.message_refused()

    def happened(self, event: ClusterEvent) -> None:
        for sink in self.sinks:
            sink.happened(event)


_sink: Events = NoEvents()
_Sink = TypeVar("_Sink", bound=Events)


def events() -> Events:
    """The sink of this process."""
    return _sink


@contextmanager
def installed(sink: _Sink) -> Iterator[_Sink]:
    """Make ``sink`` this process's sink for the block (the one before it afterwards)."""
    global _sink  # noqa: PLW0603 (the one process-wide sink, by design)
    before, _sink = _sink, sink
    try:
        yield sink
    finally:
        _sink = before
