"""The built-in placement policies: distinct hosts, exclusion, admission, errors, determinism."""

from __future__ import annotations

import attrs
import pytest

from nbos.core.errors import PlacementError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, PlacementPolicy
from nbos.scaling import (
    BinPackingPolicy,
    ClusterModel,
    LeastLoadedPolicy,
    RandomPolicy,
    subscription_ratio,
)
from nbos.scaling._index import current_index

from .conftest import cluster, host, request

ALL = [LeastLoadedPolicy, BinPackingPolicy, lambda: RandomPolicy(seed=7)]
IDS = ["least-loaded", "bin-packing", "random"]


@pytest.fixture(params=ALL, ids=IDS)
def policy(request: pytest.FixtureRequest) -> PlacementPolicy:
    made: PlacementPolicy = request.param()
    return made


def test_builtins_satisfy_the_protocol(policy: PlacementPolicy) -> None:
    assert isinstance(policy, PlacementPolicy)
    assert policy.name in IDS


def test_places_on_distinct_hosts_respecting_exclude_and_schedulable(
    policy: PlacementPolicy,
) -> None:
    view = cluster(
        host("h1"), host("h2"), host("h3"), host("h4", schedulable=False), host("h5"), host("h6")
    )
    for _ in range(20):
        chosen = policy.place(request(exclude=("h2", "h6")), view)
        assert len(chosen) == 3
        assert len(set(chosen)) == 3
        assert set(chosen) == {HostId("h1"), HostId("h3"), HostId("h5")}


def test_too_few_hosts_is_a_clear_placement_error(policy: PlacementPolicy) -> None:
    view = cluster(host("h1"), host("h2", total=2), host("h3", schedulable=False))
    with pytest.raises(PlacementError) as err:
        policy.place(request(gpus=4), view)
    text = str(err.value)
    assert "k-1" in text and "1 of 3 qualify" in text
    assert "1 not schedulable" in text and "1 with fewer than 4 GPUs" in text


def test_admission_refuses_hosts_over_the_demand_to_busy_ratio(policy: PlacementPolicy) -> None:
    # 4 GPUs x 3 replicas: ratio 1.0 allows 12 subscribed GPUs, so 11 + 1 fits, 12 + 1 does not.
    full, edge = host("full", 4, subscribed=12), host("edge", 4, subscribed=11)
    view = cluster(full, edge, host("a", 4), host("b", 4))
    assert subscription_ratio(edge, 3, 1) == pytest.approx(1.0)
    chosen = set(policy.place(request(), view))
    assert HostId("full") not in chosen
    assert chosen == {HostId("edge"), HostId("a"), HostId("b")}
    # A busier cluster (lower demand-to-busy ratio) admits less oversubscription.
    with pytest.raises(PlacementError, match=r"over the subscription limit 0\.5"):
        policy.place(request(), cluster(full, edge, host("a", 4), host("b", 4), ratio=0.5))


@pytest.mark.parametrize("bad", [request(gpus=-1), request(replicas=0)])
def test_malformed_request_is_a_placement_error(policy: PlacementPolicy, bad: object) -> None:
    with pytest.raises(PlacementError, match="bad placement request"):
        policy.place(bad, cluster(host("h1"), host("h2"), host("h3")))  # type: ignore[arg-type]


def test_malformed_cluster_view_is_a_placement_error(policy: PlacementPolicy) -> None:
    with pytest.raises(PlacementError, match="duplicate host ids"):
        policy.place(request(), cluster(host("h1"), host("h1"), host("h2")))
    with pytest.raises(PlacementError, match="bad cluster view"):
        policy.place(request(), cluster(host("h1"), host("h2"), host("h3"), ratio=float("nan")))


def test_least_loaded_picks_lowest_subscription_ratio() -> None:
    view = cluster(
        host("busy", subscribed=20),
        host("mid", subscribed=6),
        host("idle"),
        host("small", total=2, subscribed=4),  # ratio 4/2/3 = 0.67 > mid's 6/8/3 = 0.25
        host("light", subscribed=1),
    )
    assert LeastLoadedPolicy().place(request(), view) == ("idle", "light", "mid")


def test_least_loaded_puts_one_replica_where_the_first_cell_can_run() -> None:
    # The three least subscribed hosts have 3 GPUs idle at most; the kernel asks for 4.
    # Its first cell would wait for a replica to move to "roomy" or "spare": placed there,
    # it runs at once. Of the admitted hosts, the one a migration target ranks first (most
    # idle GPUs: "spare"; "over" has more, but is over the subscription limit).
    view = cluster(
        host("a", committed=5),
        host("b", committed=6, subscribed=1),
        host("c", committed=8, subscribed=2),
        host("roomy", committed=2, subscribed=9),
        host("spare", committed=1, subscribed=12),
        host("over", committed=0, subscribed=24),  # over the subscription limit
    )
    for indexed in (False, True):
        ranked = model_view(view) if indexed else view
        assert LeastLoadedPolicy().place(request(gpus=4), ranked) == ("a", "b", "spare")
        # A host among the least subscribed that can take the cell: nothing changes.
        assert LeastLoadedPolicy().place(request(gpus=3), ranked) == ("a", "b", "c")
        # Only a host over the subscription limit has 8 idle: the cell waits either way.
        assert LeastLoadedPolicy().place(request(gpus=8), ranked) == ("a", "b", "c")
        # A replica placed alone (a replacement, a drain) goes there too.
        assert LeastLoadedPolicy().place(request(gpus=4, replicas=1), ranked) == ("spare",)
    # Kernels without GPUs are spread by the replica count alone.
    assert LeastLoadedPolicy().place(request(gpus=0), view) == ("a", "b", "c")


def model_view(view: ClusterView) -> ClusterView:
    """``view``'s hosts as the cluster model keeps them: with its host index."""
    model = ClusterModel(replicas_per_kernel=view.replicas_per_kernel)
    for h in view.hosts:
        model.add_host(h.host_id, h.gpus_total)
        model.commit(h.host_id, h.gpus_committed)
        if h.gpus_subscribed:
            model.place(KernelId(f"sub-{h.host_id}"), [h.host_id], h.gpus_subscribed)
    indexed = attrs.evolve(model.view(), demand_to_busy_ratio=view.demand_to_busy_ratio)
    assert current_index(indexed) is not None
    return indexed


def test_bin_packing_fills_most_subscribed_admissible_hosts() -> None:
    view = cluster(
        host("over", subscribed=24),  # would exceed ratio 1.0
        host("busy", subscribed=20),
        host("mid", subscribed=6),
        host("idle"),
        host("small", total=2, subscribed=4),
    )
    assert BinPackingPolicy().place(request(), view) == ("busy", "small", "mid")


def test_random_policy_is_reproducible_with_a_seed() -> None:
    view = cluster(*(host(f"h{i}") for i in range(10)))
    one, again = RandomPolicy(seed=1), RandomPolicy(seed=1)
    seq = [one.place(request(), view) for _ in range(10)]
    assert seq == [again.place(request(), view) for _ in range(10)]
    assert len(set(seq)) > 1  # it does vary from call to call
    assert [RandomPolicy(seed=2).place(request(), view) for _ in range(10)] != seq
    # Host order in the view does not change the outcome.
    shuffled = cluster(*reversed(view.hosts))
    assert RandomPolicy(seed=3).place(request(), view) == RandomPolicy(seed=3).place(
        request(), shuffled
    )


def test_migration_targets() -> None:
    view = cluster(
        host("r1", committed=8),
        host("roomy", committed=1),
        host("tight", committed=6),
        host("off", committed=0, schedulable=False),
        host("full", committed=7),
    )
    req = request(gpus=2, exclude=("r1",))
    assert LeastLoadedPolicy().migration_target(req, view) == "roomy"
    assert BinPackingPolicy().migration_target(req, view) == "tight"
    assert RandomPolicy(seed=0).migration_target(req, view) in {"roomy", "tight"}
    too_big = request(gpus=8, exclude=("r1",))
    for policy in (LeastLoadedPolicy(), BinPackingPolicy(), RandomPolicy(seed=0)):
        assert policy.migration_target(too_big, view) is None
