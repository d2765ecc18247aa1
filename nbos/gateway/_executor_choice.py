"""The GPU-aware executor chooser: the kernel front's :class:`ExecutorChooser` on the scheduler.

For each cell it works out how many GPUs the cell asks for
(:func:`nbos.gateway.requests.cell_gpus`: a ``%%gpus N`` first line, else the
``execute_request`` metadata, else the kernel's default), has the
:class:`~nbos.gateway.GpuScheduler` choose the executor and pre-commit the GPUs
on its host (waiting, with the reason shown to the client, while no replica's
host can), commits them, and gives them back when the front releases the plan.

The commit is made before the plan goes back to the front, which forwards the
request at once; its executor runs it as soon as its claim commits (made early,
with the previous cell's ``Done``). Committing here rather than when the cell's first
output arrives means a refused commit stops the cell before it runs, and a
silent cell (which publishes nothing) is covered alike; the pre-commit still
guards the time a cell waits for its executor's host, and its TTL frees GPUs
whose front died before the commit.

Migration (design, "Failures, migration, scaling"): while a cell waits because no
replica's host can commit its GPUs, and the scheduler's decision for it
(:meth:`~nbos.scaling.ClusterDecisions.cell`, the simulator's too) is a
:class:`~nbos.scaling.MigrationPlan`, the chooser stops waiting, has the replica on
the plan's source host moved to its target (the :class:`Migrate` callable, a
replacement with an explicit target) and waits again, for the new replica first (the
simulator runs the cell where the replica moved).
At most one migration per waiting cell, and only while every replica is alive, so
the kernel never drops below a quorum. A failed one is logged; if its source replica runs
on (it failed before the source was removed), the cell decides again after a pause that
grows, so a move that was its only way to GPUs is tried anew; else it waits for the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio

from nbos.core.errors import NbosError, QuorumLostError
from nbos.core.executor_chooser import CellPlan, ChoiceRequest
from nbos.core.ids import HostId, KernelId
from nbos.gateway._hosts import Grant
from nbos.gateway._scheduler import GpuScheduler, MoveHold
from nbos.gateway.requests import cell_gpus
from nbos.metrics import events
from nbos.scaling.migration import MigrationPlan

log = logging.getLogger(__name__)

#: How long a cell whose migration failed waits before it decides again, at first; the
#: pause doubles after each failure, up to the second figure.
_MIGRATION_RETRY_S = 1.0
_MIGRATION_RETRY_MAX_S = 30.0

#: ``migrate(node, host, after)``: move replica ``node`` to ``host``; cells go to the new
#: replica once it applied cell ``after``. Returns the new node id.
Migrate = Callable[[int, HostId, int], Awaitable[int]]


class GpuChooser:
    """Chooses each cell's executor of kernel ``kernel_id`` by GPUs (an ``ExecutorChooser``).

    ``hosts`` maps every replica's node id to its host (copied; :meth:`replica_replaced`
    keeps the copy and the scheduler's placement up to date).
    ``default_gpus`` is the kernel's GPUs per cell; ``user`` owns the kernel (``""``:
    nobody), whose quota its cells' GPUs count against. ``release`` frees a plan's GPUs on
    every path and leaves the executor's tensors resident on them (lazy eviction); a
    replica that died loses its residency through :meth:`GpuScheduler.replica_gone`.
    """

    def __init__(
        self,
        scheduler: GpuScheduler,
        kernel_id: KernelId,
        hosts: Mapping[int, HostId],
        default_gpus: int,
        user: str = "",
    ) -> None:
        self._scheduler = scheduler
        self._user = user
        self._kernel_id = kernel_id
        self._hosts = dict(hosts)
        self._default = default_gpus
        # Plan identity -> its grant: plans of equal value may be in flight at once.
        # Each plan's grant and when the cell got it (for its run time).
        self._grants: dict[int, tuple[CellPlan, Grant, float]] = {}
        self._migration: Migrate | None = None
        self._migrating = False

    def enable_migration(self, migrate: Migrate) -> None:
        """Let waiting cells migrate a replica where the scheduler's decision says."""
        self._migration = migrate

    @property
    def default_gpus(self) -> int:
        return self._default

    @property
    def hosts(self) -> Mapping[int, HostId]:
        """Each replica's host, by node id."""
        return self._hosts

    def replica_moving(self, dead: int, host: HostId) -> None:
        """A replacement of ``dead`` starts on ``host``: the scheduler places it there now
        (the simulator's model moves a replica when the move is decided, too)."""
        old = self._hosts.get(dead)
        if old is not None and old != host:
            self._scheduler.replica_moved(self._kernel_id, old, host)

    def replica_not_moved(self, dead: int, host: HostId) -> None:
        """That replacement failed: the placement is ``dead``'s host again."""
        old = self._hosts.get(dead)
        if old is not None and old != host:
            self._scheduler.replica_moved(self._kernel_id, host, old)

    def replica_replaced(self, dead: int, node: int, host: HostId) -> None:
        """Replica ``dead`` is gone for good; ``node`` on ``host`` took its place."""
        old = self._hosts.pop(dead, None)
        self._hosts[node] = host
        if old is not None and old != host:
            self._scheduler.replica_moved(self._kernel_id, old, host)

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        """The executor and committed devices of the cell; may wait for GPUs.

        Raises :class:`~nbos.core.errors.GpuError` for a bad GPU request,
        :class:`~nbos.core.errors.InsufficientGpusError` at once when no host has
        that many GPUs, and :class:`QuorumLostError` without live replicas.
        """
        wanted = cell_gpus(request.code, request.metadata, self._default)
        replicas = {n: self._hosts[n] for n in request.alive if n in self._hosts}
        if not replicas:
            raise QuorumLostError(f"kernel {self._kernel_id} has no live replica")
        asked = time.monotonic()
        held = await self._take_over(request)
        # A retry goes where its lost attempt was to run, whose GPUs it holds: the claim
        # lost to the last executor's early one, which is no decision of the scheduler's.
        retried = request.retry_of.replica if request.retry_of is not None else None
        try:
            grant = await self._acquire(request, replicas, wanted.gpus, held, retried)
        finally:
            if held is not None:
                held.release()
        try:
            grant = await self._scheduler.committed(grant)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._scheduler.release(grant)
            raise
        code = wanted.code if wanted.source == "magic" else None
        plan = CellPlan(grant.replica, grant.devices, code=code)
        granted = time.monotonic()
        events().cell_waited(granted - asked)
        self._grants[id(plan)] = (plan, grant, granted)
        log.debug(
            "kernel %s cell %d: replica %d on %s, GPUs %s",
            self._kernel_id,
            request.exec_index,
            grant.replica,
            grant.host,
            grant.devices,
        )
        return plan

    async def _take_over(self, request: ChoiceRequest) -> MoveHold | None:
        """The GPUs of the cell's attempt whose claim lost (``request.retry_of``), held in
        the view for its retry while they go back to their host; ``None`` without any.
        Given back and taken anew, they were idle in between: another waiting cell took
        them or planned a move onto them, and the retry waited or moved again (the
        simulator has no such step: a cell's GPUs are its own until it ends). The ledger
        keeps one record of the cell, under its new index."""
        lost = request.retry_of
        entry = self._grants.get(id(lost)) if lost is not None else None
        if entry is None or lost is None:
            return None
        grant = entry[1]
        hold = self._scheduler.hold(grant.host, len(grant.devices)) if grant.devices else None
        await self.release(lost)
        self._scheduler.ledger.cell_retried(self._kernel_id, grant.exec_index, request.exec_index)
        return hold

    async def _acquire(
        self,
        request: ChoiceRequest,
        replicas: dict[int, HostId],
        gpus: int,
        held: MoveHold | None,
        executor: int | None,
    ) -> Grant:
        """The scheduler's grant for the cell; migrates a replica once if that lets it run
        (tried again while a move fails early). ``held``: GPUs held for it
        (:meth:`_take_over`); ``executor``: the replica to prefer as the last executor (else
        the request's)."""
        pause = _MIGRATION_RETRY_S
        while True:
            outcome = await self._wait(
                request, replicas, gpus, may_migrate=True, held=held, executor=executor
            )
            if isinstance(outcome, Grant):
                return outcome
            plan, hold = outcome
            source, node = await self._move(request, replicas, plan, hold)
            if node is not None or source not in self._hosts:
                break
            # The move failed early and its source runs on. A move may be the cell's only
            # way to GPUs: it may decide one again after a pause that grows, meanwhile
            # waiting (as the autoscaler sees) for GPUs where its replicas are.
            hold.release()
            with anyio.move_on_after(pause):
                grant = await self._wait(
                    request, replicas, gpus, may_migrate=False, held=held, executor=executor
                )
                assert isinstance(grant, Grant)
                return grant
            pause = min(2 * pause, _MIGRATION_RETRY_MAX_S)
        # The source was fenced (moved, or the move failed after it was removed): the cell
        # waits for the others.
        survivors = {n: h for n, h in self._hosts.items() if n in replicas and n != source}
        if node is not None:
            survivors[node] = self._hosts[node]
        # The target's GPUs stay held until this cell's own decision takes them: released
        # now, another cell could plan a move onto them first and move again after. The
        # moved replica counts as the last executor, so the cell runs where it moved, as
        # in the simulator: not on another replica's host whose GPUs freed meanwhile, which
        # were the next cell's there (and made it move in turn).
        try:
            grant = await self._wait(
                request,
                survivors,
                gpus,
                may_migrate=False,
                held=hold,
                executor=node if node is not None else executor,
            )
        finally:
            hold.release()
        assert isinstance(grant, Grant)
        return grant

    async def _move(
        self,
        request: ChoiceRequest,
        replicas: Mapping[int, HostId],
        plan: MigrationPlan,
        hold: MoveHold,
    ) -> tuple[int, int | None]:
        """Move the cell's replica on ``plan.source`` to ``plan.target`` (``hold`` released
        if this raises): that replica's node id and the new one's (``None``: it failed)."""
        began = time.time()
        try:
            if request.notify is not None:
                await request.notify(
                    f"nbos: the cell waits for a migration: its replica on {plan.source} "
                    f"moves to {plan.target}"
                )
            source = next(n for n, h in replicas.items() if h == plan.source)
            node = await self._migrate(source, plan.target, request.exec_index - 1)
        except BaseException:
            hold.release()
            raise
        self._scheduler.ledger.cell_migrated(
            self._kernel_id, request.exec_index, time.time() - began
        )
        return source, node

    async def _wait(
        self,
        request: ChoiceRequest,
        replicas: dict[int, HostId],
        gpus: int,
        *,
        may_migrate: bool,
        held: MoveHold | None = None,
        executor: int | None = None,
    ) -> Grant | tuple[MigrationPlan, MoveHold]:
        """The grant, or the scheduler's migration plan for the cell (if ``may_migrate``) with
        its target's GPUs held; ``held``: GPUs held for it already (``GpuScheduler.acquire``);
        ``executor``: the replica to prefer as the last executor, if it is one of
        ``replicas`` (else the request's)."""
        planned: tuple[MigrationPlan, MoveHold] | None = None
        notify = request.notify

        async def on_wait(reason: str) -> None:
            if notify is not None:
                await notify(f"nbos: the cell waits: {reason}")

        async def on_migrate(plan: MigrationPlan, hold: MoveHold) -> None:
            nonlocal planned
            planned = plan, hold
            scope.cancel()

        # Only with every replica alive: moving one leaves a quorum of the others.
        migrating = (
            may_migrate
            and self._migration is not None
            and not self._migrating
            and set(replicas) == set(self._hosts)
        )
        grant: Grant | None = None
        try:
            with anyio.CancelScope() as scope:
                grant = await self._scheduler.acquire(
                    self._kernel_id,
                    request.exec_index,
                    replicas,
                    last_executor=executor if executor in replicas else request.last_executor,
                    gpus=gpus,
                    on_wait=on_wait,
                    on_migrate=on_migrate if migrating else None,
                    user=self._user,
                    arrived=request.arrived,
                    held=held,
                )
        except BaseException:
            if planned is not None:  # cancelled from outside after the decision
                planned[1].release()
            raise
        if grant is None:  # on_migrate ended the wait
            assert planned is not None
            return planned
        if planned is not None:  # granted after all: the move's hold is not needed
            planned[1].release()
        return grant

    async def _migrate(self, source: int, target: HostId, after: int) -> int | None:
        """The new replica's node id, or ``None`` (logged) if the migration failed."""
        assert self._migration is not None
        log.info("kernel %s: migrating replica %d to %s", self._kernel_id, source, target)
        self._migrating = True
        try:
            node = await self._migration(source, target, after)
        except NbosError as exc:
            log.warning("kernel %s: migrating replica %d failed: %s", self._kernel_id, source, exc)
            return None
        finally:
            self._migrating = False
        self._scheduler.ledger.migrations += 1
        return node

    async def release(self, plan: CellPlan) -> None:
        """Give back the plan's GPUs (idempotent); the executor's tensors stay resident."""
        entry = self._grants.pop(id(plan), None)
        if entry is None:
            return
        _, grant, granted = entry
        events().cell_ran(time.monotonic() - granted)
        with anyio.CancelScope(shield=True):
            await self._scheduler.release(grant, resident=True)
