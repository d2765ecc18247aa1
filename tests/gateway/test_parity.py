"""The live decision path makes the moves the simulator makes: the gateway's scheduler,
with real agents, gives the autoscaler the inputs the simulator gives it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from nbos.core.errors import KernelError
from nbos.core.executor_chooser import ChoiceRequest
from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant, MoveHold
from nbos.gateway._executor_choice import GpuChooser
from nbos.gateway.service import GatewayService
from nbos.scaling import (
    AutoscalerConfig,
    Hold,
    ScaleOut,
)
from nbos.scaling.autoscaler import Autoscaler
from nbos.scaling.decisions import ClusterDecisions
from nbos.scaling.migration import MigrationPlan
from tests._wait import eventually
from tests.agent._daemons import DEADLINE
from tests.gateway._cluster import Cluster, cluster, kernel, replicas
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

FOUR = {"h0": (0,), "h1": (0,), "h2": (0,), "h3": (0,)}


def decisions() -> ClusterDecisions:
    return ClusterDecisions.load("least-loaded", 3, Autoscaler(AutoscalerConfig(min_hosts=3)))


async def hog(c: Cluster, *hosts: str) -> list[Grant]:
    """One GPU of each of ``hosts`` committed, by a kernel of its own."""
    grants = []
    for host in hosts:
        grant = await c.scheduler.acquire(
            kernel(f"hog-{host}"), 1, replicas(host), last_executor=0, gpus=1
        )
        grants.append(await c.scheduler.committed(grant))
    return grants


async def test_a_cell_waiting_for_a_move_another_host_allows_does_not_scale_out() -> None:
    """Three hosts' GPUs are held; k's replicas are on them and h3's GPU is idle. k's cell
    waits (its migration cannot start: the kernel is moving a replica already, say). The
    simulator never keeps a cell whose decision is a move waiting (it moves the replica,
    tests/scaling/test_simulator.py's migration tests), so it adds no host for it; the live
    autoscaler counted every waiting cell as a placement failure and scaled out."""
    async with cluster(FOUR, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2")
        k_hosts = replicas("h0", "h1", "h2")
        decision = c.scheduler.decisions.cell(
            c.scheduler.view(), kernel("k"), list(k_hosts.values()), None, 1
        )
        assert decision == MigrationPlan(kernel("k"), HostId("h0"), HostId("h3"))
        async with anyio.create_task_group() as tg:
            # No on_migrate: this cell may not move a replica now, so it waits.
            tg.start_soon(
                lambda: c.scheduler.acquire(kernel("k"), 1, k_hosts, last_executor=None, gpus=1)
            )
            await eventually(lambda: (kernel("k"), 1) in c.scheduler.waiting())
            live = c.scheduler.scale(now=1000.0)
            tg.cancel_scope.cancel()
        # Load 3/4 under scale_out_load 0.9, no cell without a host: nothing to add.
        assert isinstance(live.decision, Hold), live.decision
        assert not live.at_ceiling


async def test_a_cell_no_host_can_take_still_scales_out() -> None:
    async with cluster(FOUR, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2", "h3")
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: c.scheduler.acquire(
                    kernel("k"), 1, replicas("h0", "h1", "h2"), last_executor=None, gpus=1
                )
            )
            await eventually(lambda: (kernel("k"), 1) in c.scheduler.waiting())
            live = c.scheduler.scale(now=1000.0)
            tg.cancel_scope.cancel()
        assert isinstance(live.decision, ScaleOut), live.decision


async def test_with_precopy_an_idle_kernels_replica_moves_before_its_cell_needs_it(
    tmp_path: Path,
) -> None:
    """``[gateway] precopy``: k's three hosts fill up while k is idle; the autoscaler adds a
    host and, at a later period, copies one of k's replicas there. k's next cell then runs
    on it at once: no migration happens while the cell waits, and its state is intact."""
    settings = local_settings(
        tmp_path,
        autoscale=True,
        min_hosts=3,
        max_hosts=4,
        autoscale_period_s=0.3,
        scale_out_cooldown_s=0.0,
        scale_in_cooldown_s=600.0,  # the new host stays, idle or not
        idle_grace_s=600.0,
        precopy=True,
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        scheduler = service.directory.scheduler
        ledger = scheduler.ledger
        k = await service.kernel_manager.start_kernel(gpus=2)
        assert (await k.execute("%%gpus 0\nx = 40")).status == "ok"
        first = {r.host for r in k.replicas}
        for i, host in enumerate(sorted(first), start=1):
            grant = await scheduler.acquire(
                KernelId(f"hog-{i}"), 1, {1: HostId(host)}, last_executor=None, gpus=2
            )
            await scheduler.committed(grant)
        # Load 1.0: a host is added, then k, idle, has a replica copied there.
        await eventually(
            lambda: ledger.migrations == 1 and not {r.host for r in k.replicas} <= first,
            timeout=2 * DEADLINE,
        )
        ran = await k.execute("%%gpus 2\ny = x + 2\nprint(y)", timeout=DEADLINE)
        assert ran.status == "ok" and ran.stdout == "42\n", ran.reply
        assert ledger.migrations == 1  # the cell found its GPUs: it did not wait for a move
        cell = next(c for c in ledger.cells() if c.kernel_id == k.kernel_id and c.gpus == 2)
        assert cell.started is not None
        digests = await k.digests()
        assert len(digests) == 3 and len(set(digests.values())) == 1, digests


async def test_a_moves_target_gpus_are_held_from_the_decision_so_no_second_cell_plans_on_them() -> (
    None
):
    """Two cells wait (every host's GPU is held). A host with one GPU joins: the simulator
    moves the first cell there and commits the GPU in the same step, so the second waits.
    Live, the move's GPUs were held only once the migration began, a few awaits after the
    decision, and the second cell planned a move onto the same GPU meanwhile (two moves
    where the simulator makes one)."""
    hosts = {f"h{i}": (0,) for i in range(5)}
    async with cluster(hosts, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2", "h3", "h4")
        plans: dict[str, MigrationPlan] = {}
        holds: list[MoveHold] = []

        def cell(name: str, *on: str) -> Callable[[], Awaitable[object]]:
            async def on_migrate(plan: MigrationPlan, hold: MoveHold) -> None:
                plans[name] = plan  # the move is under way: the hold stays
                holds.append(hold)

            return lambda: c.scheduler.acquire(
                kernel(name), 1, replicas(*on), last_executor=None, gpus=1, on_migrate=on_migrate
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(cell("a", "h0", "h1", "h2"))
            tg.start_soon(cell("b", "h2", "h3", "h4"))
            await eventually(lambda: len(c.scheduler.waiting()) == 2)
            await c.start_agent("h5", (0,))
            await eventually(lambda: len(plans) == 1)
            await anyio.sleep(0.5)  # both cells decided again since h5 joined (poll 0.1 s)
            tg.cancel_scope.cancel()
        assert [p.target for p in plans.values()] == ["h5"]
        assert c.scheduler.view().host(HostId("h5")).gpus_idle == 0
        for hold in holds:
            hold.release()
        assert c.scheduler.view().host(HostId("h5")).gpus_idle == 1


async def test_a_cell_that_decided_a_move_plans_no_second_one_on_top_of_its_own_hold() -> None:
    """Two hosts outside the cell's replicas have a GPU idle. The cell's decision is a move
    to one of them, whose GPU is held from then on. That hold changed the view, so the wait
    decided again before the caller's cancel took effect, saw the first target taken (by
    its own hold) and proposed a move to the second, with a second hold. The caller kept
    the last plan; the first hold was never released: a replay kept 16 GPUs committed on
    two hosts without a replica for the rest of its run, and scaled out on that load."""
    hosts = {f"h{i}": (0,) for i in range(5)}
    async with cluster(hosts, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2")
        planned: list[tuple[MigrationPlan, MoveHold]] = []

        async def on_migrate(plan: MigrationPlan, hold: MoveHold) -> None:
            planned.append((plan, hold))  # as the executor choice does: the wait is over
            scope.cancel()

        with anyio.CancelScope() as scope:
            await c.scheduler.acquire(
                kernel("k"), 1, replicas("h0", "h1", "h2"), last_executor=None, gpus=1,
                on_migrate=on_migrate,
            )  # fmt: skip
        assert len(planned) == 1
        planned[0][1].release()
        view = c.scheduler.view()
        assert [view.host(HostId(h)).gpus_idle for h in ("h3", "h4")] == [1, 1]


async def test_gpus_being_pre_committed_are_held_so_no_other_cell_plans_a_move_onto_them() -> None:
    """a's cell can run on h5, whose GPU is idle; while the gateway asks h5's agent to
    pre-commit it (a round trip, slow here), b's cell, whose replicas' hosts are full,
    decides. The simulator commits a's GPU in the step that decides it, so b waits; live,
    the GPU still looked idle until the agent answered, and b planned a move onto it that
    a's grant then made useless (the replay's cells moved twice: onto a host taken
    meanwhile, then on)."""
    hosts = {f"h{i}": (0,) for i in range(6)}
    async with cluster(hosts, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2", "h3", "h4")
        plans: list[MigrationPlan] = []

        async def on_migrate(plan: MigrationPlan, hold: MoveHold) -> None:
            plans.append(plan)
            hold.release()

        granted: list[Grant] = []

        async def cell_a() -> None:
            granted.append(
                await c.scheduler.acquire(
                    kernel("a"), 1, replicas("h3", "h4", "h5"), last_executor=None, gpus=1
                )
            )

        c.network.delay = (0.1, 0.1)  # each message: a pre-commit's round trip takes 0.2 s
        async with anyio.create_task_group() as tg:
            tg.start_soon(cell_a)
            await anyio.sleep(0.02)  # a decided on h5 and asks its agent
            tg.start_soon(
                lambda: c.scheduler.acquire(
                    kernel("b"), 1, replicas("h0", "h1", "h2"), last_executor=None, gpus=1,
                    on_migrate=on_migrate,
                )
            )  # fmt: skip
            await eventually(lambda: (kernel("b"), 1) in c.scheduler.waiting())
            await eventually(lambda: bool(granted), timeout=DEADLINE)
            await anyio.sleep(0.3)  # b decided again once a's grant changed the view
            tg.cancel_scope.cancel()
        assert granted[0].host == HostId("h5")
        assert plans == []


async def test_a_cell_whose_claim_lost_keeps_its_gpus_for_its_retry() -> None:
    """a's cell got h0's GPU, but its executor's claim lost (the last executor had claimed
    the index early), so it goes again under a new index. b, on the same hosts, waits for a
    GPU meanwhile. Given back and asked for anew, the GPU was b's (or a move onto it was
    b's plan) and a's retry waited or moved again; the simulator has no such step. The
    retry (``ChoiceRequest.retry_of``) takes its own GPU over and b keeps waiting."""
    hosts = {"h0": (0,), "h1": (0,), "h2": (0,)}
    async with cluster(hosts, policy=decisions()) as c:
        await hog(c, "h1", "h2")
        on = replicas("h0", "h1", "h2")
        chooser = GpuChooser(c.scheduler, kernel("a"), on, default_gpus=1)
        first = await chooser.choose(ChoiceRequest(1, None, (0, 1, 2)))
        assert first.replica == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: c.scheduler.acquire(kernel("b"), 1, on, last_executor=None, gpus=1)
            )
            await eventually(lambda: (kernel("b"), 1) in c.scheduler.waiting())
            with anyio.fail_after(DEADLINE):
                retry = await chooser.choose(ChoiceRequest(2, None, (0, 1, 2), retry_of=first))
            await chooser.release(first)  # the front's release of the lost attempt: a no-op
            assert retry.replica == 0
            assert (kernel("b"), 1) in c.scheduler.waiting()
            # One cell, one record: under the retry's index, ready since its first attempt.
            ledger = c.scheduler.ledger
            assert ledger.cell(kernel("a"), 1) is None
            record = ledger.cell(kernel("a"), 2)
            assert record is not None and record.started is not None and record.ended is None
            assert [u.exec_index for u in ledger.cells() if u.kernel_id == kernel("a")] == [2]
            assert c.scheduler.view().host(HostId("h0")).gpus_idle == 0
            await chooser.release(retry)
            await eventually(lambda: (kernel("b"), 1) not in c.scheduler.waiting())
            tg.cancel_scope.cancel()


async def test_a_cell_runs_where_its_replica_moved_though_its_last_executors_gpus_freed() -> None:
    """Every replica host's GPU is held, so the cell moves a replica to h3. While it moves,
    the GPU of the last executor's host (h2) is given back. The simulator runs the cell on
    h3, whose GPU it committed when it decided, and leaves h2's to whoever comes next; live,
    the cell decided again after the move, ran on h2 and let h3's hold go, and the next cell
    of h2's kernels had to move in turn (a replay made two moves the simulator did not)."""
    async with cluster(FOUR, policy=decisions()) as c:
        hogs = dict(zip(("h0", "h1", "h2"), await hog(c, "h0", "h1", "h2"), strict=True))
        on = replicas("h0", "h1", "h2")
        chooser = GpuChooser(c.scheduler, kernel("a"), on, default_gpus=1)

        async def migrate(source: int, target: HostId, after: int) -> int:
            assert on[source] != HostId("h2"), "the test needs the last executor to stay"
            await c.scheduler.release(hogs["h2"])  # the last executor's host frees up
            chooser.replica_replaced(source, 3, target)
            return 3

        chooser.enable_migration(migrate)
        with anyio.fail_after(DEADLINE):
            plan = await chooser.choose(ChoiceRequest(1, 2, (0, 1, 2)))
        assert chooser.hosts[plan.replica] == HostId("h3")
        assert c.scheduler.view().host(HostId("h2")).gpus_idle == 1
        await chooser.release(plan)


async def test_a_retried_cell_runs_where_its_lost_attempt_was_to_run() -> None:
    """a's last executor (replica 1, on h1) had no GPU idle, so a's cell went to replica 0
    on h0; the last executor's early claim of the index won, so the cell goes again under
    a new index. Meanwhile h1's GPU came free. The simulator has no claims: the cell runs
    where it was decided. Live, the retry was decided anew with the claim's winner as the
    last executor and ran on h1, leaving h0's GPU to others (in a replay, a cell that had
    moved a replica ran elsewhere, and the next cell there moved in turn)."""
    hosts = {"h0": (0,), "h1": (0,), "h2": (0,)}
    async with cluster(hosts, policy=decisions()) as c:
        hogs = await hog(c, "h1", "h2")
        chooser = GpuChooser(c.scheduler, kernel("a"), replicas("h0", "h1", "h2"), 1)
        first = await chooser.choose(ChoiceRequest(1, 1, (0, 1, 2)))
        assert first.replica == 0
        await c.scheduler.release(hogs[0])
        with anyio.fail_after(DEADLINE):
            retry = await chooser.choose(ChoiceRequest(2, 1, (0, 1, 2), retry_of=first))
        await chooser.release(first)
        assert retry.replica == 0
        assert c.scheduler.view().host(HostId("h1")).gpus_idle == 1
        await chooser.release(retry)


async def test_a_retry_whose_lost_attempts_replica_died_goes_to_the_last_executor() -> None:
    """The lost attempt's replica (0) died before the retry: the retry is decided as any
    cell, its last executor (2) first, not as a cell without one."""
    hosts = {"h0": (0,), "h1": (0,), "h2": (0,)}
    async with cluster(hosts, policy=decisions()) as c:
        chooser = GpuChooser(c.scheduler, kernel("a"), replicas("h0", "h1", "h2"), 1)
        first = await chooser.choose(ChoiceRequest(1, 0, (0, 1, 2)))
        assert first.replica == 0
        with anyio.fail_after(DEADLINE):
            retry = await chooser.choose(ChoiceRequest(2, 2, (1, 2), retry_of=first))
        await chooser.release(first)
        assert retry.replica == 2
        await chooser.release(retry)


async def test_a_cell_whose_move_failed_early_moves_again_and_runs_where_it_moved() -> None:
    """Every replica host's GPU is held for good, and h3's is idle: the cell's one way to a
    GPU is a move. The first move fails before its source was removed (the target's agent
    was not ready, say), so the source runs on. The cell decides again and moves; it used
    to wait for its other replicas' GPUs for ever."""
    async with cluster(FOUR, policy=decisions()) as c:
        await hog(c, "h0", "h1", "h2")
        chooser = GpuChooser(c.scheduler, kernel("a"), replicas("h0", "h1", "h2"), 1)
        tries: list[tuple[int, HostId]] = []

        async def migrate(source: int, target: HostId, after: int) -> int:
            tries.append((source, target))
            if len(tries) == 1:
                raise KernelError(f"replica {source} not replaced: the target did not answer")
            chooser.replica_replaced(source, 3, target)
            return 3

        chooser.enable_migration(migrate)
        with anyio.fail_after(DEADLINE):
            plan = await chooser.choose(ChoiceRequest(1, 2, (0, 1, 2)))
        assert [target for _, target in tries] == [HostId("h3")] * 2
        assert plan.replica == 3 and chooser.hosts[3] == HostId("h3")
        await chooser.release(plan)
