"""Stateful property test of the autoscaler against a cluster that follows its decisions.

Hypothesis draws a config, then random load over time: GPUs committed and replicas
per host change, time advances, placement sometimes fails. Each decision is
carried out: a scale-out's hosts join after a start-up delay (counted as
provisioning until then), a scale-in's hosts drain and leave once their GPUs are
free. After every step: hosts never exceed ``max_hosts`` (provisioning included)
and schedulable hosts never fall below the floor once reached; no two actions
fall within the later one's cooldown; a step never adds or drains more than
``max_step`` hosts; a drained host was schedulable with no committed GPUs and at
most ``drain_max_replicas`` replicas.

Sizes: ``NBOS_PROPERTY_EXAMPLES`` (default 60) and ``NBOS_PROPERTY_STEPS`` (default 40).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView
from nbos.scaling import Autoscaler, AutoscalerConfig, ScaleIn, ScaleOut
from tests.property._support import sized

GPUS = 4
REPLICAS_PER_KERNEL = 3
STARTUP = 90.0


@dataclass
class Host:
    committed: int = 0
    replicas: int = 0
    subscribed: int = 0
    schedulable: bool = True


class AutoscaledCluster(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.hosts: dict[str, Host] = {}
        self.joining: list[tuple[float, int]] = []  # (join time, count)
        self.serial = 0
        self.actions: list[tuple[float, ScaleOut | ScaleIn]] = []
        self.floor_reached = False

    @initialize(
        min_hosts=st.integers(1, 4),
        extra=st.integers(0, 5),
        out_load=st.sampled_from([0.75, 0.9, 1.0]),
        in_gap=st.sampled_from([0.2, 0.4, 0.6]),
        cooldowns=st.tuples(st.sampled_from([0.0, 60.0, 120.0]), st.sampled_from([60.0, 300.0])),
        idle_grace=st.sampled_from([0.0, 120.0]),
        max_step=st.integers(1, 3),
        drain_max_replicas=st.integers(0, 3),
        start=st.integers(0, 7),
    )
    def configure(
        self,
        min_hosts: int,
        extra: int,
        out_load: float,
        in_gap: float,
        cooldowns: tuple[float, float],
        idle_grace: float,
        max_step: int,
        drain_max_replicas: int,
        start: int,
    ) -> None:
        self.config = AutoscalerConfig(
            min_hosts=min_hosts,
            max_hosts=min_hosts + extra,
            scale_out_load=out_load,
            scale_in_load=out_load - in_gap,
            scale_out_cooldown=cooldowns[0],
            scale_in_cooldown=cooldowns[1],
            idle_grace=idle_grace,
            max_step=max_step,
            drain_max_replicas=drain_max_replicas,
            new_host_gpus=GPUS,
        )
        self.scaler = Autoscaler(self.config)
        for _ in range(min(start, self.config.max_hosts)):
            self._add_host()

    # --- the world changes ----------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 1.0, 30.0, 60.0, 200.0, 700.0]), placement_failed=st.booleans())
    def tick(self, dt: float, placement_failed: bool) -> None:
        """Time passes, hosts join and leave, and the autoscaler decides (as the gateway's loop)."""
        self._advance(dt)
        self._decide(placement_failed)

    def _advance(self, dt: float) -> None:
        self.now += dt
        due = [(t, n) for t, n in self.joining if t <= self.now]
        self.joining = [(t, n) for t, n in self.joining if t > self.now]
        for _, n in due:
            for _ in range(n):
                self._add_host()
        # Draining hosts leave once their GPUs are free (replicas moved by the caller).
        for name in [n for n, h in self.hosts.items() if not h.schedulable and not h.committed]:
            del self.hosts[name]

    @precondition(lambda self: bool(self.hosts))
    @rule(data=st.data(), committed=st.integers(0, GPUS), replicas=st.integers(0, 6))
    def load(self, data: st.DataObject, committed: int, replicas: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.hosts)))
        host = self.hosts[name]
        host.committed = committed
        if host.schedulable:  # a draining host takes no new replicas
            host.replicas = replicas
            host.subscribed = replicas
        else:
            host.replicas = host.subscribed = 0

    def _decide(self, placement_failed: bool) -> None:
        before = {n: Host(**vars(h)) for n, h in self.hosts.items()}
        provisioning = sum(n for _, n in self.joining)
        decision = self.scaler.decide(self._view(), self.now, placement_failed, provisioning)
        if isinstance(decision, ScaleOut):
            assert 1 <= decision.count <= self.config.max_step
            self.joining.append((self.now + STARTUP, decision.count))
            self.actions.append((self.now, decision))
        elif isinstance(decision, ScaleIn):
            assert 1 <= len(decision.hosts) <= self.config.max_step
            for h in decision.hosts:
                drained = before[h]
                assert drained.schedulable, h
                assert drained.committed == 0, h
                assert drained.replicas <= self.config.drain_max_replicas, h
                self.hosts[h].schedulable = False
            self.actions.append((self.now, decision))

    # --- what must always hold --------------------------------------------------------

    @invariant()
    def within_max_hosts(self) -> None:
        if hasattr(self, "config"):
            assert len(self.hosts) + sum(n for _, n in self.joining) <= self.config.max_hosts

    @invariant()
    def never_below_the_floor_once_reached(self) -> None:
        if not hasattr(self, "config"):
            return
        floor = min(max(self.config.min_hosts, REPLICAS_PER_KERNEL), self.config.max_hosts)
        schedulable = sum(h.schedulable for h in self.hosts.values())
        if schedulable >= floor:
            self.floor_reached = True
        elif self.floor_reached:
            raise AssertionError(f"{schedulable} schedulable hosts, floor {floor}")

    @invariant()
    def actions_respect_cooldowns(self) -> None:
        for (t0, _), (t1, second) in zip(self.actions, self.actions[1:], strict=False):
            cooldown = (
                self.config.scale_out_cooldown
                if isinstance(second, ScaleOut)
                else self.config.scale_in_cooldown
            )
            assert t1 - t0 >= cooldown, (t0, t1, second)

    # --- helpers ----------------------------------------------------------------------

    def _add_host(self) -> None:
        self.hosts[f"h{self.serial:03d}"] = Host()
        self.serial += 1

    def _view(self) -> ClusterView:
        hosts = [
            HostView(HostId(n), GPUS, h.committed, h.subscribed, h.replicas, h.schedulable)
            for n, h in sorted(self.hosts.items())
        ]
        # A high ratio: subscriptions never block draining here; the load rules do.
        return ClusterView(hosts, REPLICAS_PER_KERNEL, 10.0)


AutoscaledCluster.TestCase.settings = sized()
TestAutoscaledCluster = AutoscaledCluster.TestCase
