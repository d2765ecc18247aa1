"""One host's GPU accounting: which device is idle, pre-committed or committed, and to whom.

The pool is pure bookkeeping: synchronous, no I/O, time read only through the
``clock`` it is given, so the host agent can wrap it and tests can drive it with
a plain function. Every reservation goes through a one-way lifecycle::

    precommitted --commit--> committed --release--> released
         |                                  ^
         +------------ release -------------+
         +--expire / agent restart--> (gone; a later commit with kernel and
                                       count takes fresh devices)

Operations that would move a reservation backwards are no-ops that return its
current :class:`Allocation`, which makes ``commit`` and ``release`` idempotent
under retried or duplicated messages.

Lazy eviction: a released device may still hold the releasing kernel's tensors
(``release(..., resident=True)``). Allocation prefers devices where the same
kernel is resident, then devices with no resident state, then devices of the
caller's ``evict_first`` kernels (the fair share's: users over quota); when it must hand out a
device that another kernel is resident on, the allocation's ``evict_from`` names
that kernel, and the caller has it evict before the new holder binds the device.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal

import attrs

from nbos.core.errors import ConfigError, GpuError, InsufficientGpusError, UnknownReservationError
from nbos.core.ids import KernelId

log = logging.getLogger(__name__)

ReservationState = Literal["precommitted", "committed", "released", "expired"]

#: How many finished reservations the pool remembers so that retries stay no-ops.
DEFAULT_TOMBSTONES = 4096


@attrs.frozen
class Allocation:
    """A reservation as the pool holds it (or held it, for released and expired ones).

    ``evict_from`` maps a device to the kernel whose resident tensors must be
    evicted from it before this reservation's holder uses it, as found when the
    devices were taken; it stays on the live reservation so that retries see it too.
    """

    reservation_id: str
    kernel_id: KernelId
    devices: tuple[int, ...]
    state: ReservationState
    created_at: float
    evict_from: Mapping[int, KernelId] = attrs.field(factory=dict)


@attrs.frozen
class PoolCounts:
    """Device counts by state; ``idle + precommitted + committed == total`` always."""

    total: int
    idle: int
    precommitted: int
    committed: int


class GpuPool:
    """Accounting for the devices of one host.

    Contracts:

    * a device belongs to at most one live (pre-committed or committed) reservation;
    * ``counts()`` never goes negative and always sums to ``total``;
    * ``precommit``/``commit`` raise :class:`InsufficientGpusError` when fewer than
      ``n`` devices are idle, and change nothing in that case;
    * one kernel has at most one replica per host, so ``release_kernel`` frees
      everything a dead replica or kernel held here.
    """

    def __init__(
        self,
        devices: Sequence[int],
        clock: Callable[[], float],
        precommit_ttl: float,
        *,
        tombstones: int = DEFAULT_TOMBSTONES,
    ) -> None:
        if len(set(devices)) != len(devices) or any(d < 0 for d in devices):
            raise _logged(
                ConfigError("devices", list(devices), "distinct non-negative device indices")
            )
        if tombstones < 0:
            raise _logged(ConfigError("tombstones", tombstones, "a non-negative count"))
        if not precommit_ttl > 0:
            raise _logged(
                ConfigError("precommit_ttl", precommit_ttl, "a positive number of seconds")
            )
        self._devices = tuple(sorted(devices))
        self._clock = clock
        self._ttl = precommit_ttl
        self._live: dict[str, Allocation] = {}
        self._owner: dict[int, str] = {}  # device -> live reservation id
        self._resident: dict[int, KernelId] = {}
        self._finished: OrderedDict[str, Allocation] = OrderedDict()
        self._tombstones = tombstones

    @classmethod
    def restore(
        cls,
        devices: Sequence[int],
        clock: Callable[[], float],
        precommit_ttl: float,
        committed: Iterable[Allocation],
        resident: Mapping[int, KernelId] | None = None,
    ) -> GpuPool:
        """Rebuild a pool after an agent restart from the reservations it reports committed.

        Pre-commits do not survive a restart (their cells re-acquire on commit).
        Raises :class:`GpuError` if the report holds anything but committed
        reservations, names unknown devices or binds a device twice: such a report
        cannot be trusted, and the half-built pool is discarded.
        """
        pool = cls(devices, clock, precommit_ttl)
        for alloc in committed:
            if alloc.state != "committed" or alloc.reservation_id in pool._live:
                raise _logged(
                    GpuError(f"restore: bad report entry {alloc.reservation_id!r} ({alloc.state})")
                )
            pool._take(alloc.reservation_id, alloc.kernel_id, alloc.devices, "committed")
        for device, kernel in (resident or {}).items():
            pool._check_known(device)
            # A committed device holds its holder's state; an older mark on it is stale.
            if device not in pool._owner:
                pool._resident[device] = kernel
        return pool

    # --- queries ---------------------------------------------------------------

    @property
    def devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def precommit_ttl(self) -> float:
        return self._ttl

    def counts(self) -> PoolCounts:
        pre = sum(len(a.devices) for a in self._live.values() if a.state == "precommitted")
        com = sum(len(a.devices) for a in self._live.values() if a.state == "committed")
        return PoolCounts(len(self._devices), len(self._devices) - pre - com, pre, com)

    def idle_devices(self) -> tuple[int, ...]:
        return tuple(d for d in self._devices if d not in self._owner)

    def reservations(self) -> tuple[Allocation, ...]:
        """Live reservations (pre-committed and committed), oldest first."""
        return tuple(self._live.values())

    def committed(self) -> tuple[Allocation, ...]:
        """Committed reservations: what an agent reports so a restart can ``restore`` it."""
        return tuple(a for a in self._live.values() if a.state == "committed")

    def owner(self, device: int) -> str | None:
        """The live reservation holding ``device``, if any."""
        return self._owner.get(device)

    def resident(self) -> Mapping[int, KernelId]:
        """Idle devices that still hold a kernel's tensors (lazy eviction)."""
        return dict(self._resident)

    def lookup(self, reservation_id: str) -> Allocation | None:
        """The reservation, live or remembered as finished, or ``None``."""
        return self._live.get(reservation_id) or self._finished.get(reservation_id)

    # --- transitions -------------------------------------------------------------

    def precommit(
        self,
        reservation_id: str,
        kernel_id: KernelId,
        n: int,
        *,
        evict_first: Collection[KernelId] = (),
    ) -> Allocation:
        """Reserve ``n`` idle devices for an expected executor of ``kernel_id``.

        Devices where another kernel is resident are taken last, those of the
        ``evict_first`` kernels before the others.

        Repeating a call for a live reservation returns it unchanged (if the kernel
        and count match; otherwise :class:`GpuError`). A finished reservation id is
        never reused: precommitting it again returns its finished allocation.
        """
        existing = self._existing(reservation_id, kernel_id, n)
        if existing is not None:
            return existing
        return self._allocate(reservation_id, kernel_id, n, "precommitted", evict_first)

    def commit(
        self,
        reservation_id: str,
        kernel_id: KernelId | None = None,
        n: int | None = None,
        *,
        evict_first: Collection[KernelId] = (),
    ) -> Allocation:
        """Bind a reservation to a running cell.

        A pre-commit becomes a commit; a committed or released reservation is left
        as it is (idempotent). A reservation the pool does not hold (never made,
        expired, lost in an agent restart) is taken fresh from idle devices when
        ``kernel_id`` and ``n`` are given (as :meth:`precommit` takes them), else
        :class:`UnknownReservationError`.
        """
        alloc = self._live.get(reservation_id)
        if alloc is not None:
            self._check_same(alloc, kernel_id, n)
            if alloc.state == "precommitted":
                alloc = attrs.evolve(alloc, state="committed")
                self._live[reservation_id] = alloc
                log.debug("commit %s: devices %s", reservation_id, alloc.devices)
            return alloc
        finished = self._finished.get(reservation_id)
        if finished is not None and finished.state == "released":
            self._check_same(finished, kernel_id, n)
            return finished
        if kernel_id is None or n is None:
            why = "expired" if finished is not None else "unknown"
            log.info("commit of %s reservation %s refused", why, reservation_id)
            raise UnknownReservationError(reservation_id, why)
        return self._allocate(reservation_id, kernel_id, n, "committed", evict_first)

    def release(self, reservation_id: str, *, resident: bool = False) -> tuple[int, ...]:
        """Free a reservation's devices and return them; a repeat returns the same devices.

        With ``resident=True`` the devices are remembered as still holding the
        kernel's tensors (lazy eviction). Releasing an id the pool never saw (or
        has forgotten) returns ``()``.
        """
        alloc = self._live.pop(reservation_id, None)
        if alloc is None:
            finished = self._finished.get(reservation_id)
            return finished.devices if finished is not None else ()
        self._finish(alloc, "released")
        for d in alloc.devices:
            if resident:
                self._resident[d] = alloc.kernel_id
            else:
                self._resident.pop(d, None)
        log.debug("release %s: devices %s resident=%s", reservation_id, alloc.devices, resident)
        return alloc.devices

    def expire(self) -> tuple[Allocation, ...]:
        """Free pre-commits that no cell claimed within ``precommit_ttl``; return them."""
        now = self._clock()
        stale = [
            a
            for a in self._live.values()
            if a.state == "precommitted" and now - a.created_at >= self._ttl
        ]
        for alloc in stale:
            del self._live[alloc.reservation_id]
            self._finish(alloc, "expired")
            log.info("pre-commit %s of kernel %s expired", alloc.reservation_id, alloc.kernel_id)
        return tuple(stale)

    def release_kernel(self, kernel_id: KernelId) -> tuple[Allocation, ...]:
        """Free every reservation and resident mark of a dead replica or kernel."""
        dead = [a for a in self._live.values() if a.kernel_id == kernel_id]
        for alloc in dead:
            del self._live[alloc.reservation_id]
            self._finish(alloc, "released")
        self.evicted(kernel_id)
        if dead:
            log.info("kernel %s gone: freed %d reservations", kernel_id, len(dead))
        return tuple(dead)

    def evicted(self, kernel_id: KernelId) -> None:
        """Record that ``kernel_id`` moved its resident tensors off every device here."""
        for d in [d for d, k in self._resident.items() if k == kernel_id]:
            del self._resident[d]

    # --- internals ---------------------------------------------------------------

    def _existing(self, reservation_id: str, kernel_id: KernelId, n: int) -> Allocation | None:
        alloc = self._live.get(reservation_id) or self._finished.get(reservation_id)
        if alloc is None or alloc.state == "expired":
            return None
        self._check_same(alloc, kernel_id, n)
        return alloc

    @staticmethod
    def _check_same(alloc: Allocation, kernel_id: KernelId | None, n: int | None) -> None:
        if (kernel_id is not None and kernel_id != alloc.kernel_id) or (
            n is not None and n != len(alloc.devices)
        ):
            raise _logged(
                GpuError(
                    f"reservation {alloc.reservation_id!r} belongs to kernel {alloc.kernel_id!r} "
                    f"with {len(alloc.devices)} devices; asked again for kernel {kernel_id!r}, "
                    f"n={n}"
                )
            )

    def _allocate(
        self,
        reservation_id: str,
        kernel_id: KernelId,
        n: int,
        state: ReservationState,
        evict_first: Collection[KernelId],
    ) -> Allocation:
        if n < 0:
            raise _logged(GpuError(f"reservation {reservation_id!r}: device count {n} < 0"))
        idle = self.idle_devices()
        if n > len(idle):
            log.info("kernel %s asked for %d GPUs, %d idle", kernel_id, n, len(idle))
            raise InsufficientGpusError(n, len(idle), "host GPU pool")
        rank = functools.partial(self._eviction_rank, kernel_id=kernel_id, first=evict_first)
        chosen = sorted(idle, key=lambda d: (rank(d), d))[:n]
        return self._take(reservation_id, kernel_id, tuple(sorted(chosen)), state)

    def _eviction_rank(
        self, device: int, *, kernel_id: KernelId, first: Collection[KernelId]
    ) -> int:
        holder = self._resident.get(device)
        if holder == kernel_id:
            return 0
        if holder is None:
            return 1
        return 2 if holder in first else 3

    def _take(
        self,
        reservation_id: str,
        kernel_id: KernelId,
        devices: tuple[int, ...],
        state: ReservationState,
    ) -> Allocation:
        for d in devices:
            self._check_known(d)
            if d in self._owner:
                raise _logged(GpuError(f"device {d} is already held by {self._owner[d]!r}"))
        evict = {d: k for d in devices if (k := self._resident.get(d)) not in (None, kernel_id)}
        for d in devices:
            self._owner[d] = reservation_id
            # The holder's state is on the device now; a foreign one is about to be evicted.
            self._resident.pop(d, None)
        self._finished.pop(reservation_id, None)
        alloc = Allocation(reservation_id, kernel_id, devices, state, self._clock(), evict)
        self._live[reservation_id] = alloc
        log.debug("%s %s: kernel %s devices %s", state, reservation_id, kernel_id, devices)
        return alloc

    def _check_known(self, device: int) -> None:
        if device not in self._devices:
            raise _logged(GpuError(f"device {device} is not in this pool {list(self._devices)}"))

    def _finish(self, alloc: Allocation, state: ReservationState) -> None:
        for d in alloc.devices:
            del self._owner[d]
        self._finished[alloc.reservation_id] = attrs.evolve(alloc, state=state, evict_from={})
        while len(self._finished) > self._tombstones:
            self._finished.popitem(last=False)


def _logged(error: GpuError | ConfigError) -> GpuError | ConfigError:
    log.warning("GPU pool refused a request: %s", error)
    return error
