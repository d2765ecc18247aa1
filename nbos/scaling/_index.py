"""Schedulable hosts kept sorted by what least-loaded ranks them on, so a decision need not scan.

A :class:`~nbos.core.placement.ClusterView` lists every host, and ranking them all costs
O(hosts) per decision. :class:`HostIndex` keeps the schedulable hosts in sorted lists
(bisect; an update moves one entry), grouped so that the best admitted hosts are at the
front of each group:

* by GPU count: ``(subscribed, committed, host id)``. Among hosts of one size the
  subscription ratio after a placement grows with ``subscribed`` (distinct integer
  counts give distinct ratios: they are far below 2**40; on hosts without GPUs the
  ratio is 0 or inf, so there only "subscribed at all" counts), so the least-loaded
  hosts of a size are its first entries, and admission (ratio within the limit) is a
  prefix;
* by idle GPUs and GPU count: ``(subscribed, host id)``, for the migration target (most
  idle GPUs, then lowest ratio, then host id) and for "may a replica move at all".

Each answer reads the first entries of a few groups (hosts of one size and idle count),
skipping excluded hosts, and merges them by the plain rule's full key, so it is the plain
rule's answer; ``tests/property/test_host_index.py`` checks that on random clusters.

:class:`~nbos.scaling.model.ClusterModel` keeps the index in step with the views it
builds, and hands it out in an :class:`IndexedView`. The index describes the latest
view only: :func:`current_index` gives it for that view and ``None`` for an older one
(or a view built elsewhere), whose callers scan instead.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import attrs

from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView

_Load = tuple[int, int, int, HostId]
_Room = tuple[int, HostId]


class HostIndex:
    """The schedulable hosts of one cluster, sorted for least-loaded's two rankings."""

    def __init__(self) -> None:
        #: Bumped by every change, so that a view can tell whether the index is still its.
        self.version = 0
        self._views: dict[HostId, HostView] = {}
        self._load: dict[int, list[_Load]] = {}
        self._room: dict[tuple[int, int], list[_Room]] = {}

    def put(self, view: HostView) -> None:
        """Index the host as ``view`` shows it (an unschedulable one leaves the index)."""
        old = self._views.get(view.host_id)
        if old == view:
            return
        self.version += 1
        if old is not None:
            self._unlist(old)
        if view.schedulable:
            self._views[view.host_id] = view
            bisect.insort(self._load.setdefault(view.gpus_total, []), _load(view))
            room = self._room.setdefault((view.gpus_idle, view.gpus_total), [])
            bisect.insort(room, (_rank(view), view.host_id))

    def discard(self, host_id: HostId) -> None:
        """The host left the cluster."""
        old = self._views.get(host_id)
        if old is not None:
            self.version += 1
            self._unlist(old)

    def lowest_load(self, gpus: int, exclude: frozenset[HostId]) -> Iterator[Iterator[HostView]]:
        """Per GPU count of at least ``gpus``: its hosts outside ``exclude``, least loaded first."""
        for total, entries in self._load.items():
            if total >= gpus:
                yield (self._views[h] for *_, h in entries if h not in exclude)

    def most_room(self, gpus: int, exclude: frozenset[HostId]) -> Iterator[list[HostView]]:
        """Per idle count of at least ``gpus``, most idle first: the least subscribed host
        outside ``exclude`` of each GPU count with that many idle (lists never empty)."""
        for idle in sorted({idle for idle, _ in self._room}, reverse=True):
            if idle < gpus:
                return
            firsts = [
                self._views[first]
                for (n, _), entries in self._room.items()
                if n == idle and (first := _first(entries, exclude)) is not None
            ]
            if firsts:
                yield firsts

    def _unlist(self, view: HostView) -> None:
        del self._views[view.host_id]
        load = self._load[view.gpus_total]
        del load[bisect.bisect_left(load, _load(view))]
        if not load:
            del self._load[view.gpus_total]
        key = (view.gpus_idle, view.gpus_total)
        room = self._room[key]
        del room[bisect.bisect_left(room, (_rank(view), view.host_id))]
        if not room:
            del self._room[key]


@attrs.frozen
class IndexedView(ClusterView):
    """A view with the index its maker kept in step with it (as of ``version``)."""

    index: HostIndex = attrs.field(kw_only=True, eq=False, repr=False)
    version: int = attrs.field(kw_only=True, eq=False, repr=False)


def current_index(cluster: ClusterView) -> HostIndex | None:
    """The index that describes ``cluster`` exactly, or ``None`` (scan the view instead)."""
    if isinstance(cluster, IndexedView) and cluster.version == cluster.index.version:
        return cluster.index
    return None


def _rank(view: HostView) -> int:
    """What orders the host's ratio after a placement among hosts of its size: its
    subscription, except on a host without GPUs, whose ratio is 0 unsubscribed, else inf."""
    return view.gpus_subscribed if view.gpus_total > 0 else min(view.gpus_subscribed, 1)


def _load(view: HostView) -> _Load:
    return (_rank(view), view.gpus_committed, view.replicas, view.host_id)


def _first(entries: Iterable[_Room], exclude: frozenset[HostId]) -> HostId | None:
    return next((h for _, h in entries if h not in exclude), None)
