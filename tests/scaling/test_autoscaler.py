"""The autoscaler's rules on hand-built cluster views."""

from __future__ import annotations

from typing import Any

import pytest

from nbos.core.errors import ConfigError, ScalingError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView
from nbos.scaling import (
    Autoscaler,
    AutoscalerConfig,
    ClusterDecisions,
    ClusterModel,
    Hold,
    HostLimits,
    LeastLoadedPolicy,
    ScaleIn,
    ScaleOut,
    smoothed_demand_ratio,
)

from .conftest import cluster


def hv(
    name: str,
    committed: int = 0,
    replicas: int = 0,
    subscribed: int = 0,
    total: int = 8,
    schedulable: bool = True,
) -> HostView:
    return HostView(HostId(name), total, committed, subscribed, replicas, schedulable)


def idle_cluster(n: int) -> ClusterView:
    return cluster(*(hv(f"h{i}") for i in range(n)))


FAST = AutoscalerConfig(idle_grace=0, scale_in_cooldown=0, scale_out_cooldown=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scale_in_load", 0.9),  # no hysteresis band
        ("scale_out_load", 1.5),
        ("max_hosts", 2),  # below min_hosts=3
        ("max_step", 0),
        ("idle_grace", -1.0),
        ("spare_hosts", -1),
        ("spare_hosts", 65),  # above max_hosts=64: it could never be kept
    ],
)
def test_inconsistent_config_is_refused(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as err:
        AutoscalerConfig(**kwargs)
    assert err.value.key == field


def test_scale_out_at_the_load_threshold_sized_to_the_target_load() -> None:
    cfg = AutoscalerConfig(max_step=5)
    # 21 of 24 committed: load 0.875, below 0.9.
    assert isinstance(Autoscaler(cfg).decide(cluster(hv("a", 8), hv("b", 8), hv("c", 5)), 0), Hold)
    # 22 of 24: load 0.92. Target 0.7 needs ceil(22 / 0.7) = 32 GPUs: one more 8-GPU host.
    decision = Autoscaler(cfg).decide(cluster(hv("a", 8), hv("b", 8), hv("c", 6)), 0)
    assert decision == ScaleOut(1, "load 0.92 >= 0.9")
    # 24 of 24: ceil(24 / 0.7) = 35 GPUs, 11 more: two hosts.
    full = cluster(hv("a", 8), hv("b", 8), hv("c", 8))
    assert Autoscaler(cfg).decide(full, 0) == ScaleOut(2, "load 1.00 >= 0.9")
    # ... but never more than max_step per decision.
    assert Autoscaler(AutoscalerConfig(max_step=1)).decide(full, 0) == ScaleOut(
        1, "load 1.00 >= 0.9"
    )


def test_draining_hosts_count_as_no_capacity() -> None:
    # 16 committed on 3 hosts would be 0.67, but the third is draining: 16 / 16.
    v = cluster(hv("a", 8), hv("b", 8), hv("c", schedulable=False))
    v2 = cluster(hv("a", 8), hv("b", 8), hv("c"))
    assert isinstance(Autoscaler().decide(v, 0), ScaleOut)
    assert isinstance(Autoscaler().decide(v2, 0), Hold)


def test_placement_failure_scales_out_at_low_load() -> None:
    decision = Autoscaler().decide(idle_cluster(3), 0, placement_failed=True)
    assert decision == ScaleOut(1, "placement failed")


def test_placement_failure_waits_for_hosts_already_provisioning() -> None:
    scaler = Autoscaler(AutoscalerConfig(scale_out_cooldown=60))
    assert isinstance(scaler.decide(idle_cluster(3), 0, placement_failed=True), ScaleOut)
    # Ten minutes later the host still boots: no second host for the same failure.
    held = scaler.decide(idle_cluster(3), 600, placement_failed=True, provisioning=1)
    assert held == Hold("placement failed, 1 hosts already provisioning")
    # ... but load at the threshold, counting the coming host (80 / 88), still adds capacity.
    full = cluster(*(hv(f"h{i}", 8) for i in range(10)))
    assert scaler.decide(full, 600, placement_failed=True, provisioning=1) == ScaleOut(
        2, "placement failed"
    )


def test_below_the_floor_it_adds_hosts_up_to_min_hosts() -> None:
    assert Autoscaler().decide(idle_cluster(1), 0) == ScaleOut(2, "2 hosts below the minimum")
    # The floor is at least the replication factor even with a smaller min_hosts.
    cfg = AutoscalerConfig(min_hosts=1, max_step=5)
    assert Autoscaler(cfg).decide(cluster(hv("a"), replicas_per_kernel=3), 0) == ScaleOut(
        2, "2 hosts below the minimum"
    )
    # Hosts already being provisioned count.
    assert isinstance(Autoscaler().decide(idle_cluster(1), 0, provisioning=2), Hold)


def test_max_hosts_caps_scale_out_including_provisioning() -> None:
    cfg = AutoscalerConfig(min_hosts=3, max_hosts=4, max_step=5)
    full = cluster(hv("a", 8), hv("b", 8), hv("c", 8))
    assert Autoscaler(cfg).decide(full, 0) == ScaleOut(1, "load 1.00 >= 0.9")
    at_max = cluster(*full.hosts, hv("d", 8))
    held = Autoscaler(cfg).decide(at_max, 0, placement_failed=True)
    assert held == Hold("placement failed, but at max_hosts=4")
    # A host on its way counts: 24 of 25 GPUs (new hosts of 1 GPU) is still overloaded.
    small = AutoscalerConfig(min_hosts=3, max_hosts=4, new_host_gpus=1)
    held = Autoscaler(small).decide(full, 0, provisioning=1)
    assert held == Hold("load 0.96 >= 0.9, but at max_hosts=4")


def test_cooldown_separates_actions() -> None:
    scaler = Autoscaler(AutoscalerConfig(scale_out_cooldown=120))
    full = cluster(hv("a", 8), hv("b", 8), hv("c", 8))
    assert isinstance(scaler.decide(full, 0), ScaleOut)
    cooling = scaler.decide(full, 119)
    assert isinstance(cooling, Hold)
    assert "cooling down" in cooling.reason
    assert isinstance(scaler.decide(full, 120), ScaleOut)
    assert scaler.last_action_at == 120


def test_scale_in_waits_for_idle_grace_and_cooldown_then_drains_fewest_replicas() -> None:
    cfg = AutoscalerConfig(idle_grace=600, scale_in_cooldown=300, max_step=2)
    scaler = Autoscaler(cfg)
    hosts = cluster(hv("a", replicas=3), hv("b", replicas=1), hv("c"), hv("d", replicas=2), hv("e"))
    assert isinstance(scaler.decide(hosts, 0), Hold)  # idle since 0, grace not over
    assert isinstance(scaler.decide(hosts, 599), Hold)
    assert scaler.decide(hosts, 600) == ScaleIn((HostId("c"), HostId("e")), "load 0.00 < 0.5")
    after = cluster(hv("a", replicas=3), hv("b", replicas=1), hv("d", replicas=2))
    assert isinstance(scaler.decide(after, 700), Hold)  # at the floor of 3 anyway


def test_a_host_that_was_busy_restarts_its_idle_grace() -> None:
    scaler = Autoscaler(AutoscalerConfig(idle_grace=600, scale_in_cooldown=0))
    busy_d = cluster(hv("a"), hv("b"), hv("c"), hv("d", committed=1))
    idle = idle_cluster(3).hosts
    assert isinstance(scaler.decide(busy_d, 0), Hold)
    assert isinstance(scaler.decide(cluster(*idle, hv("d")), 500), Hold)
    assert isinstance(scaler.decide(cluster(*idle, hv("d")), 1099), Hold)
    assert scaler.decide(cluster(*idle, hv("d")), 1100) == ScaleIn(
        (HostId("d"),), "load 0.00 < 0.5"
    )


def test_scale_in_keeps_the_floor_and_never_takes_busy_or_crowded_hosts() -> None:
    cfg = AutoscalerConfig(drain_max_replicas=3, idle_grace=0, scale_in_cooldown=0, max_step=5)
    hosts = cluster(
        hv("a", committed=1),  # busy
        hv("b", replicas=4),  # too many replicas to move
        hv("c", replicas=2),
        hv("d", replicas=1),
        hv("e"),
        hv("f"),
    )
    # 6 hosts, floor 3: three may go; the idle ones with fewest replicas first.
    assert Autoscaler(cfg).decide(hosts, 0) == ScaleIn(
        (HostId("e"), HostId("f"), HostId("d")), "load 0.02 < 0.5"
    )


def test_scale_in_keeps_load_at_or_below_the_target() -> None:
    cfg = AutoscalerConfig(min_hosts=1, idle_grace=0, scale_in_cooldown=0, max_step=5)
    # 14 of 32 committed (0.44). Without c: 14 / 24 = 0.58 <= 0.7; without d too: 0.875.
    hosts = cluster(hv("a", 7), hv("b", 7), hv("c"), hv("d"), replicas_per_kernel=1)
    assert Autoscaler(cfg).decide(hosts, 0) == ScaleIn((HostId("c"),), "load 0.44 < 0.5")


def test_scale_in_keeps_subscriptions_admissible() -> None:
    cfg = AutoscalerConfig(idle_grace=0, scale_in_cooldown=0)
    crowded = [hv(n, replicas=10, subscribed=24) for n in "abc"]
    light = hv("d", replicas=1, subscribed=8)
    # 80 subscribed GPUs on 24 remaining: 80 / 24 / 3 = 1.11 > 1.0: the replicas would not fit.
    assert isinstance(Autoscaler(cfg).decide(cluster(*crowded, light), 0), Hold)
    assert Autoscaler(cfg).decide(cluster(*crowded, light, ratio=1.5), 0) == ScaleIn(
        (HostId("d"),), "load 0.00 < 0.5"
    )


def test_hysteresis_band_holds_between_the_thresholds() -> None:
    scaler = Autoscaler(FAST)
    # Loads 0.5 to 0.875 sit between scale-in (0.5) and scale-out (0.9): nothing happens.
    for t, committed in enumerate([16, 20, 28, 17, 24, 16]):
        per_host = [min(8, max(0, committed - 8 * i)) for i in range(4)]
        v = cluster(*(hv(f"h{i}", c) for i, c in enumerate(per_host)))
        assert isinstance(scaler.decide(v, float(t)), Hold), committed
    assert scaler.last_action_at is None


def test_adds_a_host_under_load_and_removes_it_later_without_thrashing() -> None:
    cfg = AutoscalerConfig(scale_out_cooldown=120, scale_in_cooldown=600, idle_grace=600)
    scaler = Autoscaler(cfg)
    actions: list[tuple[float, object]] = []
    hosts = ["h0", "h1", "h2"]
    for minute in range(120):
        t = minute * 60.0
        # 24 GPUs busy, spread over all hosts, for 30 minutes; then a light 4 GPUs on h0.
        if minute < 30:
            per_host = {h: 24 // len(hosts) + (i < 24 % len(hosts)) for i, h in enumerate(hosts)}
        else:
            per_host = {h: 4 if h == "h0" else 0 for h in hosts}
        decision = scaler.decide(cluster(*(hv(h, per_host[h]) for h in hosts)), t)
        if isinstance(decision, ScaleOut):
            hosts += [f"h{len(hosts) + i}" for i in range(decision.count)]
        elif isinstance(decision, ScaleIn):
            hosts = [h for h in hosts if h not in decision.hosts]
        if not isinstance(decision, Hold):
            actions.append((t, decision))
    kinds = [type(d).__name__ for _, d in actions]
    # One scale-out at t=0 (24/24; 24/40 = 0.6 after it), none again; then one scale-in.
    assert kinds == ["ScaleOut", "ScaleIn"]
    assert actions[0] == (0.0, ScaleOut(2, "load 1.00 >= 0.9"))
    # h1..h4 went idle at minute 30; grace 600 s -> minute 40; two per step, fewest first.
    assert actions[1] == (2400.0, ScaleIn((HostId("h1"), HostId("h2")), "load 0.10 < 0.5"))
    assert hosts == ["h0", "h3", "h4"]


def test_bad_input_raises_scaling_error() -> None:
    scaler = Autoscaler()
    scaler.decide(idle_cluster(3), 10)
    with pytest.raises(ScalingError):
        scaler.decide(idle_cluster(3), 5)  # time went backwards
    with pytest.raises(ScalingError):
        scaler.decide(cluster(hv("a"), hv("a")), 20)
    with pytest.raises(ScalingError):
        scaler.decide(idle_cluster(3), 30, provisioning=-1)
    with pytest.raises(ScalingError):
        scaler.decide(idle_cluster(3), float("nan"))


def test_the_demand_ratio_moves_a_fifth_of_the_way_to_each_sample() -> None:
    # 12 GPUs demanded, 3 busy: sample 4; from 1.0 a fifth of the way is 1.6.
    assert smoothed_demand_ratio(1.0, 12, 3) == pytest.approx(1.6)
    # Nothing busy counts as 1 busy GPU; the sample never falls below 1.
    assert smoothed_demand_ratio(1.0, 5, 0) == pytest.approx(1.8)
    assert smoothed_demand_ratio(2.0, 1, 4) == pytest.approx(1.8)
    ratio = 1.0
    for _ in range(200):
        ratio = smoothed_demand_ratio(ratio, 30, 10)
    assert ratio == pytest.approx(3.0)


def test_full_hosts_count_towards_the_floor_and_capacity() -> None:
    """A host at its replica limit takes no new replica but serves its kernels' cells: a
    cluster of full hosts is not below its floor (it scaled out "3 hosts below the
    minimum" before), and their GPUs are its capacity."""
    model = ClusterModel(3, HostLimits(max_replicas=1))
    for name in ("h0", "h1", "h2"):
        model.add_host(HostId(name), 8)
    model.place(KernelId("k"), [HostId("h0"), HostId("h1"), HostId("h2")], 1)
    model.commit(HostId("h0"), 1)
    view = model.view()
    decisions = ClusterDecisions(LeastLoadedPolicy(), 3, Autoscaler(FAST))
    step = decisions.scale(view, 0.0, cells_waiting=False, kernels_waiting=False, provisioning=0)
    assert step.decision == Hold("load 0.04, but no host can be drained")
    assert [(h.schedulable, h.full) for h in view.hosts] == [(False, True)] * 3
    # A kernel that waits for room still has a host added.
    step = decisions.scale(view, 1.0, cells_waiting=False, kernels_waiting=True, provisioning=0)
    assert step.decision == ScaleOut(1, "placement failed")
    # A drained host is out of service: the floor counts it as missing.
    model.set_schedulable(HostId("h2"), False)
    step = decisions.scale(
        model.view(), 2.0, cells_waiting=False, kernels_waiting=False, provisioning=0
    )
    assert step.decision == ScaleOut(1, "1 hosts below the minimum")


def test_spare_hosts_are_added_when_every_host_has_gpus_committed() -> None:
    """With a spare host, a cell that no replica's host can take migrates at once (a
    migration, not a host start): every host has a GPU committed, load is low, nothing
    failed, and one host is added all the same; not again while it boots."""
    scaler = Autoscaler(AutoscalerConfig(spare_hosts=1, scale_out_cooldown=0))
    busy = cluster(hv("a", 2), hv("b", 1), hv("c", 1))
    assert isinstance(Autoscaler().decide(busy, 0), Hold)
    assert scaler.decide(busy, 0) == ScaleOut(1, "1 spare hosts short")
    assert isinstance(scaler.decide(busy, 60, provisioning=1), Hold)
    # A draining or full host takes no migrating replica: it is no spare.
    away = cluster(hv("a", 2), hv("b", 1), hv("c", 1), hv("d", schedulable=False))
    assert scaler.decide(away, 120) == ScaleOut(1, "1 spare hosts short")
    assert isinstance(scaler.decide(cluster(*busy.hosts, hv("d")), 180), Hold)


def test_scale_in_keeps_the_spare_hosts() -> None:
    cfg = AutoscalerConfig(spare_hosts=1, idle_grace=0, scale_in_cooldown=0, max_step=5)
    hosts = cluster(hv("a", 1), hv("b", 1), hv("c", 1), hv("d"), hv("e", replicas=1))
    # d and e are idle; without spares both could go (load 3 / 24 after).
    assert Autoscaler(AutoscalerConfig(idle_grace=0, scale_in_cooldown=0, max_step=5)).decide(
        hosts, 0
    ) == ScaleIn((HostId("d"), HostId("e")), "load 0.07 < 0.5")
    assert Autoscaler(cfg).decide(hosts, 0) == ScaleIn((HostId("d"),), "load 0.07 < 0.5")


def test_spares_short_at_the_ceiling_let_a_full_idle_host_drain_to_make_room() -> None:
    cfg = AutoscalerConfig(max_hosts=4, spare_hosts=1, idle_grace=0, scale_in_cooldown=0)
    busy = [hv(n, 1) for n in "abc"]
    full = HostView(HostId("d"), 8, 0, 8, 2, schedulable=False, full=True)
    assert Autoscaler(cfg).decide(cluster(*busy, full), 0) == ScaleIn(
        (HostId("d"),), "load 0.09 < 0.5"
    )
    # No host that could go: the ceiling holds.
    assert Autoscaler(cfg).decide(cluster(*busy, hv("d", 1)), 0) == Hold(
        "load 0.12, but no host can be drained"
    )
