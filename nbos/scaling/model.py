"""The cluster as the scheduling decisions see it, kept up to date event by event.

:class:`ClusterModel` is the one model of a cluster, the gateway's scheduler's and
the simulator's. It holds every host's GPUs (total, committed, and held for a
migration), its subscriptions and replicas, its free memory (where known), whether it is
schedulable (not being drained) and whether it is suspected (silent), each placed kernel's
hosts, and the smoothed demand-to-busy ratio. A host that is drained, suspected or full
(at its :class:`~nbos.scaling.limits.HostLimits`) takes no new replica: the view shows it
unschedulable. Each change costs O(1) (a move
O(replicas)); :meth:`ClusterModel.view` rebuilds the
:class:`~nbos.core.placement.ClusterView` that policies take only after a change,
reusing the :class:`~nbos.core.placement.HostView` of every host that did not
change, and moves the changed hosts in its :class:`~nbos.scaling._index.HostIndex`
(handed out with the view), so that least-loaded ranks hosts without scanning them.
Counts of hosts by idle GPUs answer "could any host commit N GPUs now?" without a view,
which is what lets waiting work be skipped cheaply.

The model does no I/O and keeps no clock; what it holds is what its owner told it.
Placements and held GPUs may name a host that is not in the cluster: a restarted
gateway adopts its kernels before their hosts report, and a host may leave while a
kernel still names it. They are kept aside and count once the host joins.
Inconsistent changes (releasing more than committed, an unknown host or kernel)
raise :class:`ScalingError`.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import attrs

from nbos.core.errors import ScalingError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView
from nbos.scaling._index import HostIndex, IndexedView
from nbos.scaling.autoscaler import smoothed_demand_ratio
from nbos.scaling.limits import HostLimits

log = logging.getLogger(__name__)


@attrs.define
class _Host:
    total: int
    committed: int = 0
    #: GPUs counted as committed for a migration before its cell commits them.
    held: int = 0
    subscribed: int = 0
    kernels: set[KernelId] = attrs.Factory(set)
    schedulable: bool = True
    suspected: bool = False
    #: Available memory as its agent last reported it (``None``: not known).
    free_memory_mib: int | None = None

    @property
    def idle(self) -> int:
        return self.total - min(self.total, self.committed + self.held)

    def takes_replicas(self, limits: HostLimits) -> bool:
        """Whether a new replica may go here: not drained, not suspected, not full."""
        return (
            self.schedulable
            and not self.suspected
            and not limits.full(len(self.kernels), self.free_memory_mib)
        )

    def view(self, host_id: HostId, limits: HostLimits) -> HostView:
        full = limits.full(len(self.kernels), self.free_memory_mib)
        in_service = self.schedulable and not self.suspected
        return HostView(
            host_id,
            self.total,
            self.total - self.idle,
            self.subscribed,
            len(self.kernels),
            in_service and not full,
            in_service and full,
        )


class ClusterModel:
    """Hosts, placements, commitments and the demand ratio of one cluster; ``limits``:
    what one host takes."""

    def __init__(self, replicas_per_kernel: int = 3, limits: HostLimits | None = None) -> None:
        self._replicas_per_kernel = replicas_per_kernel
        self.limits = limits or HostLimits()
        self._hosts: dict[HostId, _Host] = {}
        # What placements and holds name on hosts not in the cluster, until they join.
        self._aside: dict[HostId, _Host] = {}
        self._placements: dict[KernelId, tuple[list[HostId], int]] = {}
        # Host views in host id order, rebuilt one slot at a time for the hosts that changed.
        self._order: list[HostId] = []
        self._slots: list[HostView | None] = []
        self._slot: dict[HostId, int] = {}
        self._stale: set[HostId] = set()
        self._view: ClusterView | None = None
        # The schedulable hosts sorted for least-loaded, in step with the latest view.
        self._index = HostIndex()
        # How many hosts have each GPU count (the largest host answers "could ever run").
        self._totals: Counter[int] = Counter()
        # How many hosts have each number of idle GPUs (all hosts; schedulable ones).
        self._idle_all: Counter[int] = Counter()
        self._idle_schedulable: Counter[int] = Counter()
        self._ratio = 1.0
        self.capacity = 0
        self.committed = 0
        self.demand = 0

    # --- reading -------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The cluster as policies see it, hosts sorted by id."""
        if self._view is None:
            # Only the changed hosts' views are rebuilt (all of them after a reindex), so
            # a decision after a change costs O(changed hosts) plus one C-level copy.
            slots, slot, index = self._slots, self._slot, self._index
            for host_id in self._stale:
                slots[slot[host_id]] = view = self._host_view(host_id)
                index.put(view)
            self._stale.clear()
            hosts: tuple[HostView, ...] = tuple(slots)  # type: ignore[arg-type]
            largest = max((n for n, count in self._totals.items() if count), default=0)
            self._view = IndexedView(
                hosts,
                self._replicas_per_kernel,
                self._ratio,
                positions=slot,
                largest=largest,
                index=index,
                version=index.version,
            )
        return self._view

    def host(self, host_id: HostId) -> HostView:
        """One host's view (``ScalingError`` if unknown)."""
        self._get(host_id)
        return self.view().hosts[self._slot[host_id]]

    @property
    def hosts(self) -> tuple[HostId, ...]:
        """Host ids, in the order they were added."""
        return tuple(self._hosts)

    def draining(self) -> list[HostId]:
        """Hosts marked unschedulable, in the order they were added."""
        return [h for h, s in self._hosts.items() if not s.schedulable]

    def is_draining(self, host_id: HostId) -> bool:
        """Whether the host is in the cluster and marked unschedulable."""
        host = self._hosts.get(host_id)
        return host is not None and not host.schedulable

    def kernels_on(self, host_id: HostId) -> set[KernelId]:
        """Kernels with a replica on the host (a copy)."""
        return set(self._get(host_id).kernels)

    def placed(self, kernel_id: KernelId) -> bool:
        return kernel_id in self._placements

    def placed_gpus(self, kernel_id: KernelId) -> int:
        """The GPUs the kernel subscribes on each of its hosts (0 if not placed)."""
        placed = self._placements.get(kernel_id)
        return placed[1] if placed is not None else 0

    def replica_hosts(self, kernel_id: KernelId) -> tuple[HostId, ...]:
        """The kernel's replica hosts, in placement order (empty if not placed)."""
        placed = self._placements.get(kernel_id)
        return tuple(placed[0]) if placed is not None else ()

    def idle(self, host_id: HostId) -> int:
        return self._get(host_id).idle

    def could_commit(self, gpus: int, *, schedulable: bool) -> bool:
        """Whether some host (some schedulable one) has ``gpus`` idle GPUs now."""
        counts = self._idle_schedulable if schedulable else self._idle_all
        return any(idle >= gpus for idle, n in counts.items() if n)

    @property
    def schedulable_hosts(self) -> int:
        """Hosts that take new replicas: schedulable, not suspected and not full."""
        return sum(self._idle_schedulable.values())

    def full_hosts(self) -> list[HostId]:
        """Hosts at their limits (``limits``), in the order they were added."""
        limits = self.limits
        return [h for h, s in self._hosts.items() if limits.full(len(s.kernels), s.free_memory_mib)]

    @property
    def demand_to_busy_ratio(self) -> float:
        return self._ratio

    # --- hosts ---------------------------------------------------------------------

    def add_host(self, host_id: HostId, gpus: int) -> None:
        """The host joins with ``gpus`` GPUs, none committed (with what was kept aside for it)."""
        if host_id in self._hosts or gpus < 0:
            raise _bad(f"cannot add host {host_id} with {gpus} GPUs")
        aside = self._aside.pop(host_id, None)
        host = _Host(gpus) if aside is None else attrs.evolve(aside, total=gpus)
        self._hosts[host_id] = host
        bisect.insort(self._order, host_id)
        self._totals[gpus] += 1
        self._reindex()
        self.capacity += gpus
        self._count(host_id, +1)

    def remove_host(self, host_id: HostId) -> None:
        """The host leaves with its GPUs; the placements and holds naming it are kept aside."""
        host = self._get(host_id)
        self._count(host_id, -1)
        del self._hosts[host_id]
        self._index.discard(host_id)
        self._order.remove(host_id)
        self._totals[host.total] -= 1
        self._reindex()
        self.capacity -= host.total
        self.committed -= host.committed
        if host.kernels or host.held:
            # Only what names the host waits aside: it comes back in service, unsuspected.
            self._aside[host_id] = _Host(
                0, held=host.held, subscribed=host.subscribed, kernels=host.kernels
            )

    def set_schedulable(self, host_id: HostId, schedulable: bool) -> None:
        """Drain the host (no new replicas) or take it back into service."""
        self._get(host_id)
        self._update(host_id, lambda h: setattr(h, "schedulable", schedulable))

    def set_free_memory(self, host_id: HostId, mib: int | None) -> None:
        """The host's available memory as its agent reported it (``None``: not known)."""
        if self._get(host_id).free_memory_mib != mib:
            self._update(host_id, lambda h: setattr(h, "free_memory_mib", mib))

    def set_suspected(self, host_id: HostId, suspected: bool) -> None:
        """Whether the host is suspected (its agent fell silent): a suspected host is no
        more schedulable in the view than a draining one, but it is not being drained."""
        self._get(host_id)
        self._update(host_id, lambda h: setattr(h, "suspected", suspected))

    # --- GPUs ----------------------------------------------------------------------

    def commit(self, host_id: HostId, gpus: int) -> None:
        host = self._get(host_id)
        self.set_gpus(host_id, host.total, host.committed + gpus)

    def release(self, host_id: HostId, gpus: int) -> None:
        host = self._get(host_id)
        self.set_gpus(host_id, host.total, host.committed - gpus)

    def set_gpus(self, host_id: HostId, total: int, committed: int) -> None:
        """The host has ``total`` GPUs, ``committed`` of them pre-committed or committed (as
        its agent reported them, with the grants it has not reported yet)."""
        host = self._get(host_id)
        if not 0 <= committed <= total:
            raise _bad(f"host {host_id}: cannot have {committed} of {total} GPUs committed")
        self._totals[host.total] -= 1
        self._totals[total] += 1
        self.capacity += total - host.total
        self.committed += committed - host.committed

        def change(h: _Host) -> None:
            h.total, h.committed = total, committed

        self._update(host_id, change)

    def hold(self, host_id: HostId, gpus: int) -> None:
        """Count ``gpus`` more (fewer, if negative) of the host's GPUs as committed: those a
        migrating cell will take there, so that nothing else takes them meanwhile."""
        host = self._hosts.get(host_id) or self._aside.get(host_id)
        if (host.held if host is not None else 0) + gpus < 0:
            raise _bad(f"host {host_id}: cannot hold {gpus} GPUs more")

        def change(h: _Host) -> None:
            h.held += gpus

        self._update(host_id, change)

    # --- placements ----------------------------------------------------------------

    def place(self, kernel_id: KernelId, hosts: Sequence[HostId], gpus: int) -> None:
        """Subscribe ``gpus`` for a replica of the kernel on each of ``hosts``."""
        if kernel_id in self._placements or len(set(hosts)) != len(hosts):
            raise _bad(f"cannot place kernel {kernel_id} on {list(hosts)}")
        self._placements[kernel_id] = (list(hosts), gpus)
        self.demand += gpus
        for h in hosts:
            self._subscribe(kernel_id, h, gpus, +1)

    def forget(self, kernel_id: KernelId) -> None:
        """The kernel ended: its subscriptions go."""
        hosts, gpus = self._placement(kernel_id)
        del self._placements[kernel_id]
        self.demand -= gpus
        for h in hosts:
            self._subscribe(kernel_id, h, gpus, -1)

    def move(self, kernel_id: KernelId, source: HostId, target: HostId) -> None:
        """Move the kernel's replica from ``source`` to ``target``, keeping its place in order."""
        hosts, gpus = self._placement(kernel_id)
        if source not in hosts or target in hosts:
            raise _bad(f"cannot move kernel {kernel_id} from {source} to {target} ({hosts})")
        hosts[hosts.index(source)] = target
        self._subscribe(kernel_id, source, gpus, -1)
        self._subscribe(kernel_id, target, gpus, +1)

    # --- demand ratio ----------------------------------------------------------------

    def observe_demand(self) -> float:
        """Move the demand-to-busy ratio one step towards demand / committed (call per change)."""
        ratio = smoothed_demand_ratio(self._ratio, self.demand, self.committed)
        if ratio != self._ratio:
            self._ratio = ratio
            self._view = None
        return ratio

    # --- internals -------------------------------------------------------------------

    def _get(self, host_id: HostId) -> _Host:
        try:
            return self._hosts[host_id]
        except KeyError:
            raise _bad(f"unknown host {host_id}") from None

    def _placement(self, kernel_id: KernelId) -> tuple[list[HostId], int]:
        try:
            return self._placements[kernel_id]
        except KeyError:
            raise _bad(f"kernel {kernel_id} is not placed") from None

    def _subscribe(self, kernel_id: KernelId, host_id: HostId, gpus: int, sign: int) -> None:
        def change(h: _Host) -> None:
            h.subscribed += sign * gpus
            if sign > 0:
                h.kernels.add(kernel_id)
            else:
                h.kernels.discard(kernel_id)

        self._update(host_id, change)

    def _update(self, host_id: HostId, change: Callable[[_Host], None]) -> None:
        """Apply ``change`` to the host in the cluster (recounted, its view rebuilt), or to
        what is kept aside for a host not in it (dropped once it names nothing)."""
        host = self._hosts.get(host_id)
        if host is None:
            aside = self._aside.setdefault(host_id, _Host(0))
            change(aside)
            if not (aside.kernels or aside.held):
                del self._aside[host_id]
            return
        self._count(host_id, -1)
        change(host)
        self._count(host_id, +1)
        self._changed(host_id)

    def _count(self, host_id: HostId, sign: int) -> None:
        host = self._get(host_id)
        self._idle_all[host.idle] += sign
        if host.takes_replicas(self.limits):
            self._idle_schedulable[host.idle] += sign

    def _changed(self, host_id: HostId) -> None:
        self._stale.add(host_id)
        self._view = None

    def _reindex(self) -> None:
        # Hosts come and go rarely: every slot is rebuilt then. A new dict, never changed
        # in place, since views hand it out as their ``positions``.
        self._slot = {h: i for i, h in enumerate(self._order)}
        self._slots = [None] * len(self._order)
        self._stale = set(self._order)
        self._view = None

    def _host_view(self, host_id: HostId) -> HostView:
        return self._hosts[host_id].view(host_id, self.limits)


def _bad(message: str) -> ScalingError:
    log.warning("%s", message)
    return ScalingError(message)
