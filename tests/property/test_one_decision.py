"""One decision for the live cluster and the simulator (issue 10), as properties.

* The gateway's answer is the decision object's answer: for random clusters of
  real host agents (in-memory network) and random placements and cells, what
  :class:`GpuScheduler` does (the hosts it places on, the host it grants a cell,
  the migration it proposes) is exactly what the cluster's
  :class:`ClusterDecisions` answers on the scheduler's own view just before.
  The simulator is built on the same object (``_Simulation.decisions``), so the
  two cannot diverge.
* On the simulator's model, for random event sequences (kernels placed, cells run
  and ended, hosts drained and removed): no GPU is committed twice (the model and
  every host's :class:`GpuPool` agree, and the pool refuses a device held), and a
  drained host holds nothing when it is removed.

Size: ``NBOS_PROPERTY_EXAMPLES`` (default 15 and 40) and ``NBOS_PROPERTY_STEPS``.
"""

from __future__ import annotations

import anyio
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nbos.core.errors import PlacementError, PolicyContractError
from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant, MoveHold
from nbos.gpu import GpuPool
from nbos.scaling import (
    ClusterDecisions,
    ClusterModel,
    Execute,
    MigrationPlan,
    SimConfig,
    Trace,
    Wait,
)
from nbos.scaling.simulator import _Simulation
from tests.gateway._cluster import cluster
from tests.property._support import sized

# --- the gateway's decisions are the decision object's --------------------------------

actions = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 3)),
        st.tuples(st.just("cell"), st.integers(0, 4), st.sampled_from([None, 0, 1, 2])),
    ),
    min_size=1,
    max_size=8,
)


@sized(examples=15)
@given(sizes=st.lists(st.integers(1, 4), min_size=3, max_size=5), steps=actions)
def test_the_gateway_answers_what_the_decision_object_answers(
    sizes: list[int], steps: list[tuple[object, ...]]
) -> None:
    anyio.run(_drive_gateway, sizes, steps)


async def _drive_gateway(sizes: list[int], steps: list[tuple[object, ...]]) -> None:
    decisions = ClusterDecisions.load("least-loaded")
    hosts = {f"h{i}": tuple(range(n)) for i, n in enumerate(sizes)}
    async with cluster(hosts, policy=decisions) as c:
        scheduler = c.scheduler
        assert scheduler.decisions is decisions
        placed: dict[KernelId, tuple[HostId, ...]] = {}
        held: list[Grant] = []
        for n, step in enumerate(steps):
            if step[0] == "place":
                gpus = int(step[1])  # type: ignore[call-overload]
                kernel = KernelId(f"k{n}")
                view = scheduler.view()
                try:
                    expected = decisions.place(view, kernel, gpus)
                except PlacementError:
                    expected = None
                try:
                    assert scheduler.place(kernel, gpus) == expected
                    placed[kernel] = expected
                except PlacementError:
                    assert expected is None
            elif placed:
                grant = await _cell(scheduler, decisions, placed, step, n)
                if grant is not None:
                    held.append(grant)
        for grant in held:
            await scheduler.release(grant)


async def _cell(
    scheduler: object,
    decisions: ClusterDecisions,
    placed: dict[KernelId, tuple[HostId, ...]],
    step: tuple[object, ...],
    n: int,
) -> Grant | None:
    from nbos.gateway import GpuScheduler

    assert isinstance(scheduler, GpuScheduler)
    kernels = sorted(placed)
    kernel = kernels[n % len(kernels)]
    gpus, last = int(step[1]), step[2]  # type: ignore[call-overload]
    hosts = placed[kernel]
    replicas = dict(enumerate(hosts))
    largest = max(h.gpus_total for h in scheduler.view().hosts)
    if gpus > largest:
        return None  # InsufficientGpusError at once, on both sides (tests/scaling)
    last_host = replicas[last] if isinstance(last, int) else None
    expected = decisions.cell(scheduler.view(), kernel, hosts, last_host, gpus)
    proposed: list[MigrationPlan] = []

    async def on_migrate(plan: MigrationPlan, hold: MoveHold) -> None:
        proposed.append(plan)
        hold.release()  # nothing moves here: the next step's view is as before

    grant = None
    with anyio.move_on_after(0.3):
        grant = await scheduler.acquire(
            kernel,
            n,
            replicas,
            last_executor=last if isinstance(last, int) else None,
            gpus=gpus,
            on_migrate=on_migrate,
        )
    if isinstance(expected, Execute):
        assert grant is not None and grant.host == expected.host
    else:
        assert grant is None  # the cell waited
        assert proposed == ([expected] if isinstance(expected, MigrationPlan) else [])
        assert isinstance(expected, MigrationPlan | Wait)
    return grant


def test_the_simulator_decides_with_the_object_it_is_given() -> None:
    decisions = ClusterDecisions.load("least-loaded")
    sim = _Simulation(Trace(()), SimConfig(hosts=3, autoscaler=None), decisions)
    assert sim.decisions is decisions


def test_the_gateway_and_the_simulator_keep_one_model_class() -> None:
    """One model of the cluster: the scheduler and the simulator keep the same class, and
    decide on the same type of view (so policies take one code path on both sides)."""
    sim = _Simulation(
        Trace(()), SimConfig(hosts=3, autoscaler=None), ClusterDecisions.load("least-loaded")
    )
    live: list[tuple[type, type]] = []

    async def gateway() -> None:
        async with cluster({"h0": (0,), "h1": (0,), "h2": (0,)}) as c:
            live.append((type(c.scheduler.model), type(c.scheduler.view())))

    anyio.run(gateway)
    [(model, view)] = live
    assert model is type(sim.model) is ClusterModel
    assert view is type(sim.model.view())


# --- on the model: no GPU committed twice, drained hosts leave empty -----------------

GPUS = 4


class ModelAccounting(RuleBasedStateMachine):
    """Random events on a ClusterModel with one GpuPool per host, every decision the object's."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions = ClusterDecisions.load("least-loaded")
        self.model = ClusterModel()
        self.pools: dict[HostId, GpuPool] = {}
        self.kernels: dict[KernelId, int] = {}
        self.running: dict[KernelId, tuple[HostId, str, int]] = {}
        self.serial = 0
        for _ in range(3):
            self.add_host()

    @rule()
    def add_host(self) -> None:
        host = HostId(f"h{self.serial:02d}")
        self.serial += 1
        self.model.add_host(host, GPUS)
        self.pools[host] = GpuPool(range(GPUS), lambda: 0.0, 60.0)

    @rule(gpus=st.integers(0, GPUS))
    def start_kernel(self, gpus: int) -> None:
        kernel = KernelId(f"k{self.serial}")
        self.serial += 1
        try:
            hosts = self.decisions.place(self.model.view(), kernel, gpus)
        except PolicyContractError:
            raise
        except PlacementError:
            return
        self.model.place(kernel, hosts, gpus)
        self.kernels[kernel] = gpus

    @precondition(lambda self: self.kernels)
    @rule(data=st.data())
    def run_cell(self, data: st.DataObject) -> None:
        idle = sorted(k for k in self.kernels if k not in self.running)
        if not idle:
            return
        kernel = data.draw(st.sampled_from(idle))
        gpus = data.draw(st.integers(0, self.kernels[kernel]))
        hosts = self.model.replica_hosts(kernel)
        decision = self.decisions.cell(self.model.view(), kernel, hosts, None, gpus)
        if isinstance(decision, MigrationPlan):
            self.model.move(kernel, decision.source, decision.target)
            self.pools[decision.source].evicted(kernel)
            host = decision.target
        elif isinstance(decision, Execute):
            host = decision.host
        else:
            return
        reservation = f"{kernel}/{self.serial}"
        self.serial += 1
        self.pools[host].commit(reservation, kernel, gpus)
        self.model.commit(host, gpus)
        self.running[kernel] = (host, reservation, gpus)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end_cell(self, data: st.DataObject) -> None:
        kernel = data.draw(st.sampled_from(sorted(self.running)))
        host, reservation, gpus = self.running.pop(kernel)
        assert len(self.pools[host].release(reservation, resident=True)) == gpus
        self.model.release(host, gpus)

    @precondition(lambda self: self.kernels)
    @rule(data=st.data())
    def stop_kernel(self, data: st.DataObject) -> None:
        idle = sorted(k for k in self.kernels if k not in self.running)
        if not idle:
            return
        kernel = data.draw(st.sampled_from(idle))
        for h in self.model.replica_hosts(kernel):
            self.pools[h].release_kernel(kernel)
        self.model.forget(kernel)
        del self.kernels[kernel]

    @precondition(lambda self: self.model.hosts)
    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        host = data.draw(st.sampled_from(list(self.model.hosts)))
        self.model.set_schedulable(host, False)
        for kernel in sorted(self.model.kernels_on(host)):
            if self.running.get(kernel, (None,))[0] == host:
                continue  # a running cell finishes first
            others = self.model.replica_hosts(kernel)
            try:
                target = self.decisions.place_one(
                    self.model.view(), kernel, self.kernels[kernel], others
                )
            except PolicyContractError:
                raise
            except PlacementError:
                continue
            self.model.move(kernel, host, target)
            self.pools[host].evicted(kernel)

    @rule()
    def remove_drained(self) -> None:
        for host in self.model.draining():
            if self.decisions.removable(self.model.host(host)):
                pool = self.pools.pop(host)
                # The property: a host removed holds nothing.
                assert not pool.reservations() and not pool.resident(), host
                assert not self.model.kernels_on(host)
                self.model.remove_host(host)

    @invariant()
    def no_gpu_committed_twice(self) -> None:
        total = 0
        for host, pool in self.pools.items():
            view = self.model.host(host)
            owners = [pool.owner(d) for d in pool.devices]
            held = [o for o in owners if o is not None]
            assert len(held) == view.gpus_committed <= view.gpus_total
            assert sum(len(a.devices) for a in pool.reservations()) == len(held)
            total += len(held)
        assert total == self.model.committed


ModelAccounting.TestCase.settings = sized(examples=40, steps=40)
TestModelAccounting = ModelAccounting.TestCase
