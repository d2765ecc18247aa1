"""The cluster model's host index answers what the plain rules answer (issue 12).

On a view from :class:`ClusterModel`, least-loaded's placement and migration target
and the cell decision read the model's :class:`HostIndex` instead of scanning every
host. For random clusters (hosts of a few sizes, random subscriptions, commitments and
draining hosts), random requests and random demand ratios, each answer (hosts, target,
cell decision, or the error and its message) is the one the same decision gives on a
plain :class:`ClusterView` of the same hosts, which has no index and so scans.

Size: ``NBOS_PROPERTY_EXAMPLES`` (default 200).
"""

from __future__ import annotations

import attrs
from hypothesis import example, given
from hypothesis import strategies as st

from nbos.core.errors import NbosError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView
from nbos.scaling import ClusterDecisions, ClusterModel
from nbos.scaling._index import current_index
from tests.property._support import sized

hosts = st.lists(
    st.tuples(
        st.sampled_from([0, 2, 4, 8]),  # GPUs
        st.integers(0, 8),  # committed (capped at the host's GPUs)
        st.integers(0, 40),  # subscribed
        st.booleans(),  # draining
    ),
    max_size=12,
)


def _model(specs: list[tuple[int, int, int, bool]]) -> ClusterModel:
    model = ClusterModel(replicas_per_kernel=3)
    for i, (total, committed, subscribed, draining) in enumerate(specs):
        host = HostId(f"h{i:02d}")
        model.add_host(host, total)
        model.commit(host, min(committed, total))
        if subscribed:
            model.place(KernelId(f"sub-{i}"), [host], subscribed)
        model.set_schedulable(host, not draining)
    return model


def _answer(decide: object, *args: object) -> object:
    try:
        return decide(*args)  # type: ignore[operator]
    except NbosError as exc:
        return (type(exc).__name__, str(exc))


@sized(examples=200)
# Hosts without GPUs: their ratios are 0 or inf whatever they subscribe (found by this test).
@example(
    specs=[(0, 0, 2, False), (0, 0, 1, False)], gpus=0, replicas=1, picks=[], last=0, ratio=0.0
)
@given(
    specs=hosts,
    gpus=st.integers(0, 9),
    replicas=st.integers(1, 4),
    picks=st.lists(st.integers(0, 12), max_size=5, unique=True),
    last=st.integers(0, 12),
    ratio=st.sampled_from([0.0, 0.25, 0.5, 1.0, 4 / 3, 2.0, 10.0, float("inf")]),
)
def test_indexed_decisions_are_the_plain_rules(
    specs: list[tuple[int, int, int, bool]],
    gpus: int,
    replicas: int,
    picks: list[int],
    last: int,
    ratio: float,
) -> None:
    model = _model(specs)
    indexed = attrs.evolve(model.view(), demand_to_busy_ratio=ratio)
    plain = ClusterView(tuple(indexed.hosts), 3, ratio)
    assert current_index(indexed) is not None and current_index(plain) is None
    chosen = [HostId(f"h{i:02d}") for i in picks]  # hosts beyond the cluster included
    decisions = ClusterDecisions.load("least-loaded", replicas)
    kernel = KernelId("k")
    assert _answer(decisions.place, indexed, kernel, gpus, chosen) == _answer(
        decisions.place, plain, kernel, gpus, chosen
    )
    assert _answer(decisions.reserve, indexed, kernel, gpus) == _answer(
        decisions.reserve, plain, kernel, gpus
    )
    if chosen:
        last_host = HostId(f"h{last:02d}")
        assert _answer(decisions.cell, indexed, kernel, chosen, last_host, gpus) == _answer(
            decisions.cell, plain, kernel, chosen, last_host, gpus
        )


def test_a_view_older_than_the_index_scans() -> None:
    """A view the model has moved on from does not read the index, which describes a newer one."""
    model = _model([(8, 0, 0, False), (8, 0, 3, False), (8, 0, 6, False), (8, 0, 0, False)])
    old = model.view()
    model.commit(HostId("h00"), 8)
    model.place(KernelId("busy"), [HostId("h03")], 24)
    assert current_index(model.view()) is not None and current_index(old) is None
    decisions = ClusterDecisions.load("least-loaded")
    # The old view still has h00 idle and h03 unsubscribed: the plain rule's answer on it.
    assert decisions.place(old, KernelId("k"), 1) == (HostId("h00"), HostId("h03"), HostId("h01"))
    assert decisions.reserve(old, KernelId("k"), 8) == HostId("h00")
