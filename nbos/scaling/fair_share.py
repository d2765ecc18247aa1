"""GPU quotas and fair share: which waiting cell may take GPUs now, a pure decision.

Each user has a guaranteed quota of GPUs (an integer; users not listed have the
default quota) and may borrow idle GPUs beyond it. A quota counts the GPUs committed
to a user's running cells (pre-committed ones included), never kernels: a kernel
start is never refused for quota. The rules, for cells waiting for GPUs:

* a waiting cell is *within quota* when its user's committed GPUs plus its own stay
  within the user's quota; otherwise it *borrows*;
* within-quota cells go before borrowing ones, then by arrival (:meth:`FairShare.order`);
* a borrowing cell never takes GPUs while a within-quota cell of another user waits
  (:meth:`FairShare.decide` answers :class:`Yield`): a user over quota is never given a
  GPU that another user under quota is waiting for;
* resident (lazily kept) GPU memory of users over their quota is evicted first
  (:meth:`FairShare.evict_first`).

Preemption happens only at cell boundaries: nothing here stops a running cell; GPUs
come back to the under-quota user as the borrowers' cells end. The user ``""`` (a
kernel started before users existed) is a user like any other, with the default
quota. The gateway's :class:`~nbos.gateway.GpuScheduler` and the simulator ask the
same object.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import attrs

from nbos.core.errors import ConfigError, GpuError
from nbos.core.ids import KernelId

log = logging.getLogger(__name__)


@attrs.frozen
class Waiter:
    """A cell waiting for GPUs: its user, the GPUs it asks for, and when it began to wait
    (any number that grows with arrival: a clock, a counter)."""

    user: str
    gpus: int
    arrival: float


@attrs.frozen
class Take:
    """The waiting cell may take GPUs now (if a host has them)."""


@attrs.frozen
class Yield:
    """The waiting cell borrows and must let ``to`` (within quota, another user's) go first."""

    waiter: Waiter
    to: Waiter

    @property
    def reason(self) -> str:
        return (
            f"waiting: user {self.waiter.user or '(none)'} is over quota "
            f"while {self.to.user or '(none)'} waits"
        )


FairDecision = Take | Yield


class FairShare:
    """The quotas of a cluster's users and the fair-share rules over them.

    ``quotas`` maps a user to their guaranteed GPUs (read at each decision: a live
    mapping's changes count at once), ``default_quota`` is that of every user not listed;
    both must be integers ``>= 0`` (:class:`ConfigError` otherwise).
    Committed GPUs are given per user to each call (a mapping ``user -> GPUs``, users
    absent hold none), so the object holds no state that could drift.
    """

    def __init__(self, quotas: Mapping[str, int], default_quota: int = 0) -> None:
        for user, quota in quotas.items():
            if not isinstance(user, str):
                raise _refused(ConfigError("quota user", user, "a user name (a string)"))
            _check_quota(f"quota of {user!r}", quota)
        _check_quota("default_quota", default_quota)
        # Not copied: a live mapping (a users file's, read again when it changes) takes
        # effect at the next decision.
        self._quotas = quotas
        self._default = default_quota

    @property
    def quotas(self) -> Mapping[str, int]:
        return dict(self._quotas)

    @property
    def default_quota(self) -> int:
        return self._default

    def quota(self, user: str) -> int:
        """The GPUs guaranteed to ``user``."""
        return self._quotas.get(user, self._default)

    def within_quota(self, waiter: Waiter, committed: Mapping[str, int]) -> bool:
        """Whether granting ``waiter`` keeps its user within their quota."""
        return _held(committed, waiter.user) + waiter.gpus <= self.quota(waiter.user)

    def order(self, waiter: Waiter, committed: Mapping[str, int]) -> tuple[bool, float]:
        """The sort key of waiting cells: within-quota ones first, then by arrival."""
        return (not self.within_quota(waiter, committed), waiter.arrival)

    def decide(
        self, waiter: Waiter, waiting: Iterable[Waiter], committed: Mapping[str, int]
    ) -> FairDecision:
        """Whether ``waiter`` may take GPUs now, with ``waiting`` the cluster's waiting cells
        (``waiter`` among them or not) and ``committed`` the GPUs each user holds.

        :class:`Take` for a within-quota cell, and for a borrowing one when no other user's
        within-quota cell waits; else :class:`Yield` to the first of those (by :meth:`order`).
        """
        if self.within_quota(waiter, committed):
            return Take()
        ahead = [w for w in waiting if w.user != waiter.user and self.within_quota(w, committed)]
        if not ahead:
            return Take()
        return Yield(waiter, min(ahead, key=lambda w: w.arrival))

    def evict_first(
        self, holders: Mapping[KernelId, str], committed: Mapping[str, int]
    ) -> frozenset[KernelId]:
        """Of kernels that may hold resident GPU memory (``kernel -> user``), those whose
        memory goes first when a device must be evicted: their users hold more than their
        quota (they borrow)."""
        return frozenset(
            k for k, user in holders.items() if _held(committed, user) > self.quota(user)
        )


class UserGpus:
    """GPUs committed per user, never negative: the count :class:`FairShare` reads."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def add(self, user: str, gpus: int) -> None:
        if gpus < 0:
            raise _logged(GpuError(f"user {user!r}: cannot commit {gpus} GPUs"))
        if gpus:
            self._held[user] = self._held.get(user, 0) + gpus

    def remove(self, user: str, gpus: int) -> None:
        """Give back ``gpus`` of ``user``'s; :class:`GpuError` for more than they hold."""
        held = self._held.get(user, 0)
        if not 0 <= gpus <= held:
            raise _logged(GpuError(f"user {user!r} holds {held} GPUs; cannot release {gpus}"))
        if held == gpus:
            self._held.pop(user, None)
        else:
            self._held[user] = held - gpus

    def view(self) -> Mapping[str, int]:
        """Users holding GPUs now, with their counts."""
        return dict(self._held)


def _held(committed: Mapping[str, int], user: str) -> int:
    return committed.get(user, 0)


def _check_quota(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refused(ConfigError(key, value, "an integer number of GPUs >= 0"))


def _refused(error: ConfigError) -> ConfigError:
    log.warning("fair share refused: %s", error)
    return error


def _logged(error: GpuError) -> GpuError:
    log.warning("%s", error)
    return error
