"""GPU quotas and fair share (issue 28) as properties of the one decision, :class:`FairShare`.

* For random quotas, holdings and waiting cells: a cell that would take its user over
  quota is given GPUs only when no other user's within-quota cell waits, and when told
  to yield it yields to the earliest of those; a within-quota cell is never held back;
  the order puts within-quota cells first, then arrival.
* A cluster of ``G`` GPUs driven by the decision alone (cells arrive, the scheduler's
  loop grants in the decision's order, cells end): committed GPUs per user never go
  negative and always sum to the GPUs in use; a borrowing grant never passes over a
  waiting within-quota cell of another user; a running cell only ends by its own end
  (never preempted); and with nothing running, some waiting cell that fits is granted
  (the rule cannot deadlock).

Size: ``NBOS_PROPERTY_EXAMPLES`` and ``NBOS_PROPERTY_STEPS``.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from nbos.core.errors import ConfigError, GpuError
from nbos.core.ids import KernelId
from nbos.scaling import FairShare, Take, UserGpus, Waiter, Yield
from tests.property._support import sized

USERS = ("", "alice", "bob", "carol")
users = st.sampled_from(USERS)
quotas = st.dictionaries(users, st.integers(0, 4), max_size=4)
waiters = st.lists(st.builds(Waiter, users, st.integers(0, 4), st.integers(0, 1000)), max_size=8)
holdings = st.dictionaries(users, st.integers(0, 6), max_size=4)


@sized(examples=200)
@given(quotas, st.integers(0, 3), waiters, holdings, st.data())
def test_a_borrowing_cell_never_passes_a_within_quota_cell_of_another_user(
    q: dict[str, int],
    default: int,
    waiting: list[Waiter],
    held: dict[str, int],
    data: st.DataObject,
) -> None:
    fair = FairShare(q, default)
    waiter = data.draw(
        st.sampled_from(waiting)
        if waiting
        else st.builds(Waiter, users, st.integers(0, 4), st.just(0))
    )

    def within(w: Waiter) -> bool:  # the rule, written out independently
        return held.get(w.user, 0) + w.gpus <= q.get(w.user, default)

    entitled_others = [w for w in waiting if w.user != waiter.user and within(w)]
    decided = fair.decide(waiter, waiting, held)
    if within(waiter) or not entitled_others:
        assert decided == Take()
    else:
        assert isinstance(decided, Yield)
        assert decided.to in entitled_others
        assert decided.to.arrival == min(w.arrival for w in entitled_others)
        assert f"user {waiter.user or '(none)'} is over quota" in decided.reason
    ordered = sorted(waiting, key=lambda w: fair.order(w, held))
    classes = [not within(w) for w in ordered]
    assert classes == sorted(classes)  # within-quota cells first
    for a, b in itertools.pairwise(ordered):
        if within(a) == within(b):
            assert a.arrival <= b.arrival


@sized(examples=100)
@given(st.lists(st.tuples(users, st.integers(-2, 5), st.booleans()), max_size=30))
def test_user_gpus_never_go_negative(ops: list[tuple[str, int, bool]]) -> None:
    counts = UserGpus()
    model: dict[str, int] = {}
    for user, gpus, adding in ops:
        if adding and gpus >= 0:
            counts.add(user, gpus)
            model[user] = model.get(user, 0) + gpus
        elif not adding and 0 <= gpus <= model.get(user, 0):
            counts.remove(user, gpus)
            model[user] = model.get(user, 0) - gpus
        else:
            with pytest.raises(GpuError):
                (counts.add if adding else counts.remove)(user, gpus)
        assert counts.view() == {u: n for u, n in model.items() if n}
        assert all(n > 0 for n in counts.view().values())


def test_quotas_are_validated() -> None:
    for bad in ({"alice": -1}, {"alice": 1.5}, {"alice": True}, {3: 1}):
        with pytest.raises(ConfigError):
            FairShare(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        FairShare({}, -1)
    fair = FairShare({"alice": 2}, default_quota=1)
    assert (fair.quota("alice"), fair.quota("bob"), fair.quota("")) == (2, 1, 1)


def test_evict_first_names_kernels_of_users_over_quota() -> None:
    fair = FairShare({"alice": 1, "bob": 2}, default_quota=0)
    holders = {KernelId("a"): "alice", KernelId("b"): "bob", KernelId("n"): ""}
    assert fair.evict_first(holders, {"alice": 2, "bob": 2}) == {"a"}
    assert fair.evict_first(holders, {"alice": 1, "bob": 3, "": 1}) == {"b", "n"}
    assert fair.evict_first(holders, {}) == frozenset()


class FairCluster(RuleBasedStateMachine):
    """``GPUS`` GPUs, cells granted by the decision in its order, as the scheduler's loop does."""

    GPUS = 4

    def __init__(self) -> None:
        super().__init__()
        self.fair = FairShare({"alice": 1, "bob": 2, "": 1}, default_quota=0)
        self.held = UserGpus()
        self.waiting: list[Waiter] = []
        self.running: list[Waiter] = []
        self.arrivals = 0

    @property
    def free(self) -> int:
        return self.GPUS - sum(w.gpus for w in self.running)

    @rule(user=users, gpus=st.integers(1, 3))
    def arrive(self, user: str, gpus: int) -> None:
        self.arrivals += 1
        self.waiting.append(Waiter(user, gpus, self.arrivals))
        self.grant()

    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        if not self.running:
            return
        cell = data.draw(st.sampled_from(self.running))
        self.running.remove(cell)
        self.held.remove(cell.user, cell.gpus)
        self.grant()

    def grant(self) -> None:
        """Grant waiting cells in the decision's order while one may take GPUs and fits."""
        while True:
            view = self.held.view()
            for w in sorted(self.waiting, key=lambda w: self.fair.order(w, view)):
                if w.gpus <= self.free and self.fair.decide(w, self.waiting, view) == Take():
                    if not self.fair.within_quota(w, view):
                        assert not any(
                            o.user != w.user and self.fair.within_quota(o, view)
                            for o in self.waiting
                        )
                    self.waiting.remove(w)
                    self.running.append(w)
                    self.held.add(w.user, w.gpus)
                    break
            else:
                return

    @invariant()
    def accounting_matches_the_running_cells(self) -> None:
        by_user: dict[str, int] = {}
        for w in self.running:
            by_user[w.user] = by_user.get(w.user, 0) + w.gpus
        assert self.held.view() == by_user
        assert 0 <= self.free <= self.GPUS

    @invariant()
    def an_idle_cluster_serves_someone(self) -> None:
        if not self.running and self.waiting:
            assert not any(w.gpus <= self.GPUS for w in self.waiting)


TestFairCluster = FairCluster.TestCase
TestFairCluster.settings = sized(examples=40, steps=40)
