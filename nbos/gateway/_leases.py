"""Kernel leases: a kernel whose owner stopped watching it is shut down.

A client that starts a kernel with a lease (the ``nbos`` kernelspec's kernel host)
keeps a :class:`~nbos.gateway.control_api.WatchKernel` pending on it. Once none was
pending for ``lease_s`` seconds, its owner is taken for dead and the kernel for an
orphan. Time the gateway itself was stalled (its checks came late) counts against no
lease: a paused gateway must not take its own silence for its clients'.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from nbos.gateway._host_liveness import OwnDelay


@attrs.define
class _Lease:
    lease_s: float
    renewed: float
    watching: int = 0


class KernelLeases:
    """The leases of a gateway's kernels, by kernel id."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._own_delay = OwnDelay()

    def grant(self, kernel_id: str, lease_s: float, now: float | None = None) -> None:
        self._leases[kernel_id] = _Lease(lease_s, time.monotonic() if now is None else now)

    def forget(self, kernel_id: str) -> None:
        self._leases.pop(kernel_id, None)

    @contextmanager
    def watched(self, kernel_id: str) -> Iterator[None]:
        """Hold ``kernel_id``'s lease (if it has one) for the block, and renew it."""
        lease = self._leases.get(kernel_id)
        if lease is None:
            yield
            return
        lease.watching += 1
        try:
            yield
        finally:
            lease.watching -= 1
            lease.renewed = time.monotonic()

    def expired(self, interval: float, now: float | None = None) -> list[str]:
        """Kernels whose lease ran out: none watched them for their ``lease_s``.

        Call it every ``interval`` seconds; a call that comes late credits every lease
        with the delay. ``now``: the monotonic clock's time (default: read it).
        """
        now = time.monotonic() if now is None else now
        late = self._own_delay.late(now, interval)
        for lease in self._leases.values():
            lease.renewed = min(now, lease.renewed + late)
        return [
            kernel_id
            for kernel_id, lease in self._leases.items()
            if not lease.watching and now - lease.renewed > lease.lease_s
        ]

    def check_interval(self) -> float:
        """How often to look for expired leases (a quarter of the shortest, at most 1 s)."""
        shortest = min((lease.lease_s for lease in self._leases.values()), default=math.inf)
        return min(1.0, max(0.05, shortest / 4))
