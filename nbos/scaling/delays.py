"""Where a cell's delay went: the split the gateway, ``nbos replay`` and the simulator report.

A cell's delay runs from when it could have started (its ``execute_request`` reached the
kernel; in a trace, its submit time or its previous cell's ideal end) to when it started
to run (its GPUs committed). It is split into:

``queue``
    waiting behind earlier cells of the same kernel;
``gpus``
    waiting for GPUs that other kernels' cells hold (or for room to place the kernel);
``scale_out``
    the part of a wait during which hosts the autoscaler asked for were being added
    (:class:`ScaleOutClock`): waiting for a new host;
``migration``
    a replica moving to a host that has the GPUs;
``overhead``
    nbos's own work on the cell's path (the rest: RPCs, a kernel's start in a replay).

The gateway and the simulator read the scale-out part of a wait off the same
:class:`ScaleOutClock`, so the two splits differ only where the clusters did.

A run ``speedup`` times faster than its trace (``nbos replay``, and the simulation beside
it, which assumes nbos's own durations ``speedup`` times as long) counts each cell's delay
*at 1x* by one rule, :func:`delay_at_1x`: what a user would have felt at the trace's own
speed, the waits other cells cause in trace seconds and nbos's own time in real seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec

#: The causes of a cell's delay, in the order the table shows them.
DelayCause = Literal["queue", "gpus", "migration", "scale_out", "overhead"]
CAUSES: tuple[DelayCause, ...] = ("queue", "gpus", "migration", "scale_out", "overhead")


class DelaySplit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cell's delay (or several cells' summed) by cause, in seconds."""

    queue: float = 0.0
    gpus: float = 0.0
    migration: float = 0.0
    scale_out: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.queue + self.gpus + self.migration + self.scale_out + self.overhead

    @property
    def own(self) -> float:
        """nbos's own part (``migration``, ``scale_out``, ``overhead``): in a replay it takes
        real seconds, where the waits other cells cause pass ``speedup`` times faster."""
        return self.migration + self.scale_out + self.overhead

    def __add__(self, other: DelaySplit) -> DelaySplit:
        return DelaySplit(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[float, ...]:
        return msgspec.structs.astuple(self)

    def scaled(self, k: float) -> DelaySplit:
        return DelaySplit(*(v * k for v in self.values()))


def split_wait(waited: float, scale_out: float) -> tuple[float, float]:
    """A wait of ``waited`` seconds during ``scale_out`` of which hosts were being added:
    ``(gpus, scale_out)``, the rule both the gateway and the simulator apply."""
    part = min(max(0.0, scale_out), max(0.0, waited))
    return max(0.0, waited) - part, part


def carried_over(previous_end: float, late: float, due: float) -> float:
    """How long a cell due at ``due`` waits behind its session's previous cell, which would
    have ended at ``previous_end`` on an unlimited cluster but was ``late``: what of that
    lateness reaches past ``due``."""
    return max(0.0, previous_end + late - due)


def delay_at_1x(split: DelaySplit, speedup: float, behind_1x: float) -> float:
    """A cell's delay as a user at 1x would feel it, of a run ``speedup`` times faster than
    its trace whose delays (``split``) are in trace seconds: the wait for GPUs that other
    cells held as it is (it passes ``speedup`` times faster too), nbos's own time
    (:attr:`DelaySplit.own`: migration, scale-out, overhead) in real seconds, and instead of
    the replayed wait behind the session's previous cell, ``behind_1x``: that cell's delay
    at 1x carried over (:func:`carried_over`). The replay and the simulation beside it
    count it alike, so their shares of cells within a second compare."""
    return behind_1x + split.gpus + split.own / speedup


class ScaleOutClock:
    """Seconds during which the autoscaler had hosts on their way, summed over time.

    Whoever scales tells it :meth:`asked` (hosts asked for) and :meth:`arrived` (they joined,
    or were given up); :meth:`reading` at the start and end of a wait tells how much of it
    overlapped a scale-out.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.provisioning = 0
        self._total = 0.0
        self._since = clock()

    def asked(self, hosts: int) -> None:
        self._advance()
        self.provisioning += hosts

    def arrived(self, hosts: int) -> None:
        self._advance()
        self.provisioning = max(0, self.provisioning - hosts)

    def reading(self) -> float:
        """Seconds with hosts provisioning, from the clock's start to now."""
        self._advance()
        return self._total

    def _advance(self) -> None:
        now = self._clock()
        if self.provisioning > 0:
            self._total += max(0.0, now - self._since)
        self._since = now
