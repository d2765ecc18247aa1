"""GPU quotas and fair share (issue 28) on the live scheduler with real agents, and the same
scenario in the simulator.

The scenario: 2 GPUs (two hosts of one virtual GPU; every kernel has a replica on
both), alice and bob each with a quota of 1. Alice holds both GPUs by borrowing (two
kernels, each running a one-GPU cell); alice's third kernel asks for a GPU, then bob's
kernel does. When alice's first cell ends, bob's cell gets the GPU before alice's
waiting one, although hers came first, and alice's other running cell runs on: nothing
is preempted. Without quotas the same run serves them in arrival order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import anyio
import pytest

from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView
from nbos.gateway import Grant
from nbos.scaling import (
    CellDecision,
    ClusterDecisions,
    Execute,
    FairShare,
    MigrationPlan,
    Session,
    SimConfig,
    Trace,
    load_policy,
    simulate,
)
from nbos.scaling.trace import Cell
from tests._wait import eventually
from tests.gateway._cluster import Cluster, cluster, kernel, replicas

QUOTAS = FairShare({"alice": 1, "bob": 1}, default_quota=0)
BOTH = replicas("h0", "h1")
#: The cells in the order they ask for GPUs: kernel, user.
ARRIVALS = (("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob"))
FAIR = ["a1", "a2", "b1", "a3"]
FIFO = ["a1", "a2", "a3", "b1"]


def committed_kernels(c: Cluster) -> set[str]:
    return {a.kernel_id for agent in c.agents.values() for a in agent.pool.committed()}


@pytest.mark.anyio
@pytest.mark.parametrize(("fair_share", "expected"), [(QUOTAS, FAIR), (None, FIFO)])
async def test_under_quota_user_gets_the_next_gpu_and_no_running_cell_is_killed(
    fair_share: FairShare | None, expected: list[str]
) -> None:
    order: list[str] = []
    started = {name: anyio.Event() for name, _ in ARRIVALS}
    done = {name: anyio.Event() for name, _ in ARRIVALS}
    async with cluster({"h0": (0,), "h1": (0,)}, fair_share=fair_share) as c:
        s = c.scheduler

        async def run_cell(name: str, user: str) -> None:
            async with s.cell(
                kernel(name), 1, BOTH, last_executor=None, gpus=1, user=user
            ) as lease:
                await lease.committed()
                order.append(name)
                started[name].set()
                await done[name].wait()

        async with anyio.create_task_group() as tg:
            with anyio.fail_after(30):
                for name, user in ARRIVALS[:2]:
                    tg.start_soon(run_cell, name, user)
                    await started[name].wait()
                assert s.user_gpus() == {"alice": 2}  # borrowing one beyond her quota
                for name, user in ARRIVALS[2:]:
                    tg.start_soon(run_cell, name, user)
                    await eventually(lambda n=name: (kernel(n), 1) in s.waiting())
                if fair_share is not None:
                    await eventually(
                        lambda: (
                            "user alice is over quota while bob waits"
                            in s.waiting().get((kernel("a3"), 1), "")
                        )
                    )
                done["a1"].set()
                await started[expected[2]].wait()
                assert order == expected[:3]
                # The GPU went to one cell; the other still waits, and a2 still runs.
                assert (kernel(expected[3]), 1) in s.waiting()
                assert "a2" in committed_kernels(c)
                assert not done["a2"].is_set()
                done[expected[2]].set()
                await started[expected[3]].wait()
                assert order == expected
                for event in done.values():
                    event.set()
        assert s.grants() == ()
        assert s.user_gpus() == {}


class RecordingDecisions(ClusterDecisions):
    """The cluster's decisions, noting each kernel whose cell they let run."""

    def __init__(self) -> None:
        super().__init__(load_policy("least-loaded"), replicas_per_kernel=2)
        self.ran: list[str] = []

    def cell(
        self,
        cluster: ClusterView,
        kernel_id: KernelId,
        replica_hosts: Sequence[HostId],
        last_host: HostId | None,
        gpus: int,
        *,
        down: Collection[HostId] = (),
    ) -> CellDecision:
        decided = super().cell(cluster, kernel_id, replica_hosts, last_host, gpus, down=down)
        if isinstance(decided, Execute | MigrationPlan):
            self.ran.append(kernel_id)
        return decided


def scenario_trace() -> Trace:
    """The live scenario as a trace: cells arrive in ``ARRIVALS`` order; a1 ends first.

    The sessions start long before their cells so that the least-loaded policy's
    subscription admission has placed all four by then.
    """
    t = 1000.0
    durations = {"a1": 100.0, "a2": 200.0, "a3": 10.0, "b1": 10.0}
    return Trace(
        tuple(
            Session(name, 0.0, 5000.0, 1, (Cell(t + i, durations[name]),), user=user)
            for i, (name, user) in enumerate(ARRIVALS)
        )
    )


@pytest.mark.parametrize(("fair_share", "expected"), [(QUOTAS, FAIR), (None, FIFO)])
def test_the_simulator_serves_the_scenario_in_the_same_order(
    fair_share: FairShare | None, expected: list[str]
) -> None:
    decisions = RecordingDecisions()
    config = SimConfig(
        hosts=2, gpus_per_host=1, replicas_per_kernel=2, autoscaler=None, fair_share=fair_share
    )
    result = simulate(scenario_trace(), config, decisions=decisions)
    assert decisions.ran == expected
    assert result.cells_unserved == 0
    assert result.migrations == 0
    by_user = {u.user: u for u in result.users}
    assert by_user["bob"].cells == 1 and by_user["alice"].cells == 3


@pytest.mark.anyio
@pytest.mark.parametrize(("fair_share", "evicted"), [(QUOTAS, ("a", (1,))), (None, ("b", (0,)))])
async def test_resident_memory_of_an_over_quota_user_is_evicted_first(
    fair_share: FairShare | None, evicted: tuple[str, tuple[int, ...]]
) -> None:
    evictions: list[tuple[KernelId, tuple[int, ...]]] = []

    async def on_evict(k: KernelId, devices: tuple[int, ...]) -> None:
        evictions.append((k, devices))

    async with cluster({"h1": (0, 1)}, fair_share=fair_share) as c:
        s = c.scheduler
        await c.start_agent("h0", (0, 1), on_evict=on_evict)
        await s.wait_for_hosts(2)
        on = {"a": "h0", "b": "h0", "c": "h0", "x": "h1"}
        for name, host in on.items():
            s.adopt_placement(kernel(name), [HostId(host)], 2)

        async def acquire(name: str, user: str, gpus: int = 1) -> Grant:
            return await s.acquire(
                kernel(name), 1, replicas(on[name]), last_executor=0, gpus=gpus, user=user
            )

        with anyio.fail_after(30):
            # Bob's tensors stay on device 0 of h0, then alice's on device 1.
            await s.release(await acquire("b", "bob"), resident=True)
            await s.release(await acquire("a", "alice"), resident=True)
            assert c.pool("h0").resident() == {0: "b", 1: "a"}
            await acquire("x", "alice", gpus=2)  # alice borrows: 2 GPUs held, quota 1
            assert s.user_gpus() == {"alice": 2}
            grant = await acquire("c", "carol")
        assert evictions == [(kernel(evicted[0]), evicted[1])]
        assert grant.devices == evicted[1]
