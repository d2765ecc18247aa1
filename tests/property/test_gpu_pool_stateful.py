"""Stateful property test of GPU accounting: host pools and the gateway's view over them.

The gateway's view is a dict of host -> :class:`GpuPool`, with every kernel having a
replica on every host; cells pick their executor with ``ClusterDecisions.cell`` over a
``ClusterView`` built from the pools and pre-commit where it says. A plain
reference model records what each reservation should be; hypothesis drives random
pre-commits, commits (after a pre-commit and direct), releases (with and without
lazy residency), clock advances with expiry, kernel deaths and agent restarts, and
after every step checks that no device is bound twice, no count is negative,
``idle + precommitted + committed == total`` and the pools agree with the model.
When every kernel has died nothing is left held.

Sizes: ``NBOS_PROPERTY_EXAMPLES`` (default 60) and ``NBOS_PROPERTY_STEPS`` (default 40).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from nbos.core.errors import InsufficientGpusError, UnknownReservationError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView
from nbos.gpu import GpuPool
from nbos.scaling import ClusterDecisions, Execute, LeastLoadedPolicy, Wait
from tests.property._support import ManualClock, sized

HOSTS = ("h0", "h1", "h2")
KERNELS = tuple(KernelId(f"k{i}") for i in range(4))
DEVICES = {"h0": (0, 1, 2, 3), "h1": (0, 1), "h2": (1, 3, 4, 7, 8)}
TTL = 10.0
DECISIONS = ClusterDecisions(LeastLoadedPolicy())

# Model states beyond the pool's own: "lost" = a pre-commit dropped by an agent
# restart; "forgotten" = a finished reservation whose memory a restart dropped.
LIVE = ("precommitted", "committed")


@dataclass
class Expected:
    host: str
    kernel: KernelId
    n: int
    state: str
    created_at: float
    devices: tuple[int, ...] = ()


class GpuAccounting(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.pools = {h: GpuPool(DEVICES[h], self.clock, TTL) for h in HOSTS}
        self.model: dict[str, Expected] = {}
        self.next_id = 0

    # --- helpers -------------------------------------------------------------

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _held(self, host: str) -> int:
        return sum(e.n for e in self.model.values() if e.host == host and e.state in LIVE)

    def _take(self, host: str, kernel: KernelId, n: int, committed: bool) -> str:
        pool, rid = self.pools[host], self._new_id()
        idle_before = pool.idle_devices()
        assert len(idle_before) == len(DEVICES[host]) - self._held(host)
        resident_before = pool.resident()
        try:
            alloc = pool.commit(rid, kernel, n) if committed else pool.precommit(rid, kernel, n)
        except InsufficientGpusError:
            assert n > len(idle_before)
            assert pool.lookup(rid) is None
            return rid
        assert n <= len(idle_before)
        assert len(alloc.devices) == n
        assert set(alloc.devices) <= set(idle_before)
        foreign = {d: k for d, k in resident_before.items() if k != kernel}
        assert alloc.evict_from == {d: foreign[d] for d in alloc.devices if d in foreign}
        # Preference: the kernel's own resident devices, then clean ones, then foreign.
        own = {d for d, k in resident_before.items() if k == kernel}
        clean = [d for d in idle_before if d not in foreign]
        assert len(own & set(alloc.devices)) == min(n, len(own))
        assert len(alloc.evict_from) == max(0, n - len(clean))
        state = "committed" if committed else "precommitted"
        self.model[rid] = Expected(host, kernel, n, state, self.clock.now, alloc.devices)
        return rid

    # --- rules ---------------------------------------------------------------

    @rule(
        target=reservations,
        host=st.sampled_from(HOSTS),
        kernel=st.sampled_from(KERNELS),
        n=st.integers(0, 5),
    )
    def precommit(self, host: str, kernel: KernelId, n: int) -> str:
        return self._take(host, kernel, n, committed=False)

    @rule(
        target=reservations,
        host=st.sampled_from(HOSTS),
        kernel=st.sampled_from(KERNELS),
        n=st.integers(0, 3),
    )
    def commit_direct(self, host: str, kernel: KernelId, n: int) -> str:
        return self._take(host, kernel, n, committed=True)

    @rule(
        target=reservations,
        kernel=st.sampled_from(KERNELS),
        last=st.sampled_from((None, *HOSTS)),
        n=st.integers(0, 6),
    )
    def cell_arrives(self, kernel: KernelId, last: str | None, n: int) -> str:
        """The gateway picks an executor from its view of the pools, then pre-commits there."""
        view = ClusterView(
            [
                HostView(HostId(h), p.counts().total, p.counts().total - p.counts().idle, 0, 0)
                for h, p in self.pools.items()
            ]
        )
        replicas = [HostId(h) for h in HOSTS]
        try:
            choice = DECISIONS.cell(view, kernel, replicas, HostId(last) if last else None, n)
        except InsufficientGpusError:
            assert n > max(len(d) for d in DEVICES.values())
            return self._new_id()
        if isinstance(choice, Execute):
            if choice.reason == "last-executor":
                assert choice.host == last
            rid = self._take(choice.host, kernel, n, committed=False)
            assert self.model[rid].state == "precommitted"
            return rid
        # Every host holds a replica, so there is nowhere to migrate: the cell waits.
        assert isinstance(choice, Wait)
        assert all(p.counts().idle < n for p in self.pools.values())
        return self._new_id()

    @rule(rid=reservations)
    def commit(self, rid: str) -> None:
        expected = self.model.get(rid)
        pool = self.pools[expected.host] if expected else self.pools[HOSTS[0]]
        if expected is None or expected.state in ("expired", "lost", "forgotten"):
            with pytest.raises(UnknownReservationError):
                pool.commit(rid)
            return
        alloc = pool.commit(rid)
        assert alloc.devices == expected.devices
        if expected.state == "precommitted":
            expected.state = "committed"
        assert alloc.state == expected.state

    @rule(rid=reservations, resident=st.booleans())
    def release(self, rid: str, resident: bool) -> None:
        expected = self.model.get(rid)
        if expected is None:
            assert all(p.release(rid) == () for p in self.pools.values())
            return
        devices = self.pools[expected.host].release(rid, resident=resident)
        if expected.state in ("lost", "forgotten"):
            assert devices == ()
            return
        assert devices == expected.devices
        if expected.state in LIVE:
            expected.state = "released"
        # A retry answers the same and changes nothing.
        assert self.pools[expected.host].release(rid) == expected.devices

    @rule(seconds=st.sampled_from([0.5, 3.0, TTL]))
    def advance_and_expire(self, seconds: float) -> None:
        self.clock.now += seconds
        due = {
            rid
            for rid, e in self.model.items()
            if e.state == "precommitted" and self.clock.now - e.created_at >= TTL
        }
        expired = {a.reservation_id for p in self.pools.values() for a in p.expire()}
        assert expired == due
        for rid in due:
            self.model[rid].state = "expired"

    @rule(kernel=st.sampled_from(KERNELS))
    def kernel_dies(self, kernel: KernelId) -> None:
        freed = {a.reservation_id for p in self.pools.values() for a in p.release_kernel(kernel)}
        held = {rid for rid, e in self.model.items() if e.kernel == kernel and e.state in LIVE}
        assert freed == held
        for rid in held:
            self.model[rid].state = "released"
        assert kernel not in {k for p in self.pools.values() for k in p.resident().values()}

    @rule(host=st.sampled_from(HOSTS))
    def agent_restarts(self, host: str) -> None:
        old = self.pools[host]
        self.pools[host] = GpuPool.restore(
            old.devices, self.clock, TTL, old.committed(), old.resident()
        )
        for e in self.model.values():
            if e.host != host:
                continue
            if e.state == "precommitted":
                e.state = "lost"
            elif e.state in ("released", "expired"):
                e.state = "forgotten"

    # --- invariants ----------------------------------------------------------

    @invariant()
    def counts_add_up_and_match_the_model(self) -> None:
        for host, pool in self.pools.items():
            c = pool.counts()
            assert min(c.idle, c.precommitted, c.committed) >= 0
            assert c.idle + c.precommitted + c.committed == c.total == len(DEVICES[host])
            for state, count in (("precommitted", c.precommitted), ("committed", c.committed)):
                assert count == sum(
                    e.n for e in self.model.values() if e.host == host and e.state == state
                )

    @invariant()
    def no_device_is_bound_twice(self) -> None:
        for pool in self.pools.values():
            bound = [d for a in pool.reservations() for d in a.devices]
            assert len(bound) == len(set(bound))
            assert set(bound) <= set(pool.devices)
            assert all(
                pool.owner(d) == a.reservation_id for a in pool.reservations() for d in a.devices
            )
            assert set(pool.idle_devices()).isdisjoint(bound)
            # Residency marks only idle devices: a held device belongs to its holder.
            assert set(pool.resident()).isdisjoint(bound)

    @invariant()
    def live_reservations_match_the_model(self) -> None:
        for host, pool in self.pools.items():
            live = {a.reservation_id: a.state for a in pool.reservations()}
            expected = {
                rid: e.state for rid, e in self.model.items() if e.host == host and e.state in LIVE
            }
            assert live == expected

    def teardown(self) -> None:
        # Every kernel dies: nothing may stay held or resident anywhere.
        for kernel in KERNELS:
            for pool in self.pools.values():
                pool.release_kernel(kernel)
        for host, pool in self.pools.items():
            assert pool.counts().idle == len(DEVICES[host])
            assert pool.reservations() == ()
            assert pool.resident() == {}


GpuAccounting.TestCase.settings = sized()
TestGpuAccounting = GpuAccounting.TestCase
