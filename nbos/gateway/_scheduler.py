"""The gateway's GPU scheduler: placement, executor choice, pre-commit, commit and release.

Design, "One cell, end to end", steps 2, 3 and 7. The scheduler keeps the
cluster's :class:`~nbos.scaling.ClusterModel` (the simulator's model) up to date
from its agents' reports and its own grants, decides with the cluster's
:class:`~nbos.scaling.ClusterDecisions` on the model's view, and makes every
reservation through the host's agent, which is the authority on its devices: a
view that is out of date costs a refused pre-commit and a retry, never a device
bound twice.

The conversation with the agents beyond a cell's grant (reports, restarts, releases
owed) is :class:`~nbos.gateway._agent_sync.AgentSync`'s. Which hosts are suspected is
the one failure detector's (:mod:`nbos.gateway._host_liveness`): the host directory's
for registered hosts, else the scheduler's own :class:`HostLiveness`.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
)
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from nbos.core.errors import (
    ConfigError,
    GpuError,
    HostUnreachableError,
    InsufficientGpusError,
    PlacementError,
    QuorumLostError,
    UnknownReservationError,
)
from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.placement import ClusterView, PlacementPolicy
from nbos.core.transport import Transport
from nbos.core.wire.agent import (
    AgentReply,
    AgentRequest,
    GpuCommit,
    GpuGranted,
    GpuPrecommit,
    GpuRefused,
)
from nbos.gateway._agent_sync import AgentSync
from nbos.gateway._host_liveness import HostLiveness
from nbos.gateway._hosts import Grant, HostRecord, Hosts
from nbos.gateway._rpc import RequestChannel
from nbos.metrics import ClusterEvent, events
from nbos.scaling import (
    ClusterDecisions,
    ClusterModel,
    Execute,
    FairShare,
    HostLimits,
    MigrationPlan,
    ScaleStep,
    Wait,
    Waiter,
    Yield,
    check_cell_gpus,
)
from nbos.scaling.delays import CAUSES, ScaleOutClock
from nbos.scaling.ledger import CellUsage, Ledger

log = logging.getLogger(__name__)

#: ``on_wait(reason)``: called when a cell starts waiting for GPUs and whenever the reason changes.
WaitCallback = Callable[[str], Awaitable[None]]
#: ``on_migrate(plan, hold)``: called when the decision for a waiting cell becomes a new
#: migration, with the target's GPUs already held for it (release ``hold`` once it is over).
MigrateCallback = Callable[[MigrationPlan, "MoveHold"], Awaitable[None]]


@attrs.define
class MoveHold:
    """A migrating cell's GPUs on the move's target, counted as committed from the decision
    on (as the simulator commits them when it decides the move) until :meth:`release`."""

    host: HostId
    gpus: int
    _release: Callable[[], None] = attrs.field(alias="release", repr=False)
    _released: bool = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Count them as idle again (idempotent): the move is over, or failed."""
        if not self._released:
            self._released = True
            self._release()


@attrs.define
class CellLease:
    """What :meth:`GpuScheduler.cell` yields: the grant, and whether to leave tensors resident.

    Set ``resident = False`` when the executor's GPU state is gone (it crashed)
    or was evicted; the default keeps it for lazy eviction.
    """

    grant: Grant
    resident: bool = True
    _scheduler: GpuScheduler = attrs.field(kw_only=True, repr=False, alias="scheduler")

    async def committed(self) -> Grant:
        """Tell the scheduler the cell started (:meth:`GpuScheduler.committed`)."""
        self.grant = await self._scheduler.committed(self.grant)
        return self.grant


class GpuScheduler:
    """Places kernels and grants GPUs to cells; build it with :meth:`serve`.

    Contracts:

    * a grant's devices are pre-committed on its host's agent before
      :meth:`acquire` returns; :meth:`release` (or leaving :meth:`cell`) frees them
      and is idempotent and safe on every path, cancellation included;
    * cells that cannot get GPUs wait, in the order of the cluster's
      :class:`~nbos.scaling.FairShare` (within-quota cells first, then by arrival;
      without one, in arrival order) per set of replica hosts, and are woken when
      GPUs are released or hosts report; a cell that would borrow beyond its user's
      quota waits while another user's within-quota cell waits anywhere in the cluster;
      a cell asking for more GPUs than any known host has gets
      :class:`InsufficientGpusError` at once;
    * an agent that does not answer within ``rpc_timeout``, or stops reporting for
      ``host_timeout`` (without a host directory, which decides that otherwise), is
      suspected (logged) and left out until it reports again; releases meant for it
      are resent then.
    """

    def __init__(
        self,
        transport: Transport,
        policy: PlacementPolicy | ClusterDecisions,
        *,
        rpc_timeout: float,
        retry_interval: float,
        host_timeout: float,
        poll_interval: float,
        replicas_per_kernel: int,
        registered: bool = False,
        limits: HostLimits | None = None,
        fair_share: FairShare | None = None,
    ) -> None:
        self._fair = fair_share
        self._decisions = (
            policy
            if isinstance(policy, ClusterDecisions)
            else ClusterDecisions(policy, replicas_per_kernel)
        )
        self._poll = poll_interval
        #: The cluster as the decisions see it: the simulator's model, kept from reports.
        self.model = ClusterModel(replicas_per_kernel, limits)
        self._hosts = Hosts(self.model)
        self._liveness = HostLiveness(self._hosts, host_timeout, self._notify)
        rpc = RequestChannel[AgentRequest, AgentReply](
            transport, timeout=rpc_timeout, retry_interval=retry_interval
        )
        self._agents = AgentSync(
            transport,
            rpc,
            self._hosts,
            self._liveness,
            notify=self._notify,
            spawn=self._spawn,
            registered=registered,
        )
        # Waiting cells with GPUs to take, by the set of their replicas' hosts.
        self._queues: dict[frozenset[HostId], dict[object, Waiter]] = {}
        self._arrivals = itertools.count()
        #: The user of each kernel that asked for GPUs (``""``: none): quotas count by user.
        self._users: dict[KernelId, str] = {}
        self._waiting: dict[tuple[KernelId, int], str] = {}
        # The waiting cells that wait for capacity: the decision found no host for them.
        self._starved: set[tuple[KernelId, int]] = set()
        self.ledger = Ledger()
        #: The hosts the autoscaler asked for that have not joined yet, and for how long
        #: there were any (the part of a cell's wait that is a scale-out's).
        self.scale_outs = ScaleOutClock()
        self._version = 0
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        transport: Transport,
        policy: PlacementPolicy | ClusterDecisions | str = "least-loaded",
        *,
        rpc_timeout: float = 2.0,
        retry_interval: float = 0.25,
        host_timeout: float = 5.0,
        poll_interval: float = 1.0,
        replicas_per_kernel: int = 3,
        registered: bool = False,
        limits: HostLimits | None = None,
        fair_share: FairShare | None = None,
    ) -> AsyncIterator[GpuScheduler]:
        """Run the scheduler on ``transport`` (the gateway's endpoint) until the block exits.

        ``policy`` is the cluster's :class:`~nbos.scaling.ClusterDecisions` (shared
        with whatever else decides for the cluster), a :class:`PlacementPolicy`, or
        the name of a registered one.
        Agents are configured with this transport's peer id and address and
        announce themselves; the scheduler learns the hosts from them. With
        ``registered``, a host counts only once :meth:`admit` named it (the host
        directory, which connects to agents with their keys, does that), and the
        scheduler never adds peers to the transport itself. ``limits``: what one host
        takes (:class:`~nbos.scaling.HostLimits`; none by default). ``fair_share``: the
        users' GPU quotas (:class:`~nbos.scaling.FairShare`); ``None``: no quotas, waiting
        cells are served in arrival order.
        """
        for key, value in (
            ("rpc_timeout", rpc_timeout),
            ("retry_interval", retry_interval),
            ("host_timeout", host_timeout),
            ("poll_interval", poll_interval),
        ):
            if not value > 0:
                raise ConfigError(key, value, "a positive number of seconds")
        if replicas_per_kernel < 1:
            raise ConfigError("replicas_per_kernel", replicas_per_kernel, "at least 1")
        chosen = (
            policy
            if isinstance(policy, ClusterDecisions)
            else ClusterDecisions.load(policy, replicas_per_kernel)
        )
        scheduler = cls(
            transport,
            chosen,
            rpc_timeout=rpc_timeout,
            retry_interval=retry_interval,
            host_timeout=host_timeout,
            poll_interval=poll_interval,
            replicas_per_kernel=replicas_per_kernel,
            registered=registered,
            limits=limits,
            fair_share=fair_share,
        )
        async with anyio.create_task_group() as tg:
            scheduler._tg = tg
            tg.start_soon(scheduler._agents.receive)
            if not registered:  # else the host directory's detector suspects hosts
                tg.start_soon(scheduler._liveness.run)
            try:
                yield scheduler
            finally:
                tg.cancel_scope.cancel()

    # --- the cluster -----------------------------------------------------------------

    def view(self) -> ClusterView:
        """Every known host as the decisions see it (suspected hosts are unschedulable)."""
        return self.model.view()

    @property
    def decisions(self) -> ClusterDecisions:
        """The cluster's decisions (its one placement policy), as the simulator makes them."""
        return self._decisions

    def host(self, host_id: HostId) -> HostRecord:
        """The scheduler's record of a host (``KeyError`` if none reported)."""
        return self._hosts[host_id]

    def grants(self) -> tuple[Grant, ...]:
        """Live grants (pre-committed or committed), oldest first."""
        return self._hosts.grants()

    @property
    def fair_share(self) -> FairShare | None:
        """The users' quotas the scheduler keeps to (``None``: none)."""
        return self._fair

    def user_gpus(self) -> Mapping[str, int]:
        """GPUs of live grants (pre-committed or committed) per user: what quotas count."""
        held: dict[str, int] = {}
        for grant in self._hosts.grants():
            user = self._users.get(grant.kernel_id, "")
            held[user] = held.get(user, 0) + len(grant.devices)
        return held

    @property
    def provisioning(self) -> int:
        """Hosts the autoscaler asked for that have not joined (nor been given up) yet."""
        return self.scale_outs.provisioning

    def hosts_asked(self, hosts: int) -> None:
        """The autoscaler asked for ``hosts`` more."""
        self.scale_outs.asked(hosts)
        self._notify()

    def hosts_arrived(self, hosts: int) -> None:
        """``hosts`` the autoscaler asked for joined, or were given up: starts waiting for a
        host look again."""
        self.scale_outs.arrived(hosts)
        self._notify()

    def waiting(self) -> Mapping[tuple[KernelId, int], str]:
        """Cells waiting for GPUs now, by ``(kernel, exec_index)``, with the reason shown."""
        return dict(self._waiting)

    def scale(self, now: float, *, kernels_waiting: bool = False) -> ScaleStep:
        """The autoscaler's decision at ``now`` over this scheduler's view, from the inputs
        the simulator gives it: only cells the decision leaves waiting for capacity (no host
        can take them, or the fair share has them yield) count as placement failed, not
        those behind an earlier cell or waiting for a move that another host makes possible
        (the simulator moves or runs those); ``kernels_waiting``: a start waits for a host
        (as the simulator's pending kernels); the hosts asked for and not yet joined count
        as provisioning (:meth:`ClusterDecisions.scale`)."""
        return self._decisions.scale(
            self.view(),
            now,
            cells_waiting=bool(self._starved),
            kernels_waiting=kernels_waiting,
            provisioning=self.provisioning,
        )

    async def wait_for_hosts(self, n: int, timeout: float = 10.0) -> None:
        """Return once ``n`` hosts reported and are not suspected; ``TimeoutError`` after
        ``timeout``."""
        with anyio.fail_after(timeout):
            while sum(not h.suspected for h in self._hosts.records()) < n:
                await self._wait_change(self._version)

    async def wait_for_host(self, host_id: HostId, timeout: float) -> None:
        """Return once ``host_id`` reported and is not suspected; ``TimeoutError`` after
        ``timeout``."""
        with anyio.fail_after(timeout):
            while not self._hosts.live(host_id):
                await self._wait_change(self._version)

    def admit(self, host_id: HostId, peer: PeerId) -> None:
        """Registration took ``host_id``'s agent at ``peer``: its reports count from now on."""
        self._agents.admit(host_id, peer)

    def host_suspected(self, host_id: HostId, why: str) -> None:
        """The host directory suspects the host: nothing new goes there until it registers
        again."""
        self._agents.suspected(host_id, why)

    def set_schedulable(self, host_id: HostId, schedulable: bool) -> None:
        """Drain a host (no new replicas; cells go to its replicas only when the kernel has
        no other live replica) or undrain it."""
        if host_id not in self._hosts:
            raise KeyError(host_id)  # the host is gone: the autoscaler's drain ends
        self.model.set_schedulable(host_id, schedulable)
        self._notify()

    def remove_host(self, host_id: HostId) -> None:
        """Forget a drained host that leaves the cluster (its agent is being stopped)."""
        self._agents.removed(host_id)
        if self._hosts.leave(host_id):
            log.info("host %s removed", host_id)
            events().happened(ClusterEvent("host-left", f"host {host_id} left", host=host_id))
        self._notify()

    # --- placement -------------------------------------------------------------------

    def place(
        self, kernel_id: KernelId, gpus: int, exclude: Iterable[HostId] = ()
    ) -> tuple[HostId, ...]:
        """Choose distinct hosts for a kernel's replicas and subscribe ``gpus`` on each.

        Raises :class:`PlacementError` when the policy cannot place it, and
        :class:`~nbos.core.errors.PolicyContractError` when it answers with anything
        but ``replicas_per_kernel`` distinct known, schedulable hosts outside ``exclude``.
        """
        hosts = self._decisions.place(self.view(), kernel_id, gpus, exclude)
        self._set_placement(kernel_id, hosts, gpus)
        self._agents.kernel_lives_on(kernel_id, hosts)
        log.info("kernel %s placed on %s (%d GPUs per cell)", kernel_id, list(hosts), gpus)
        self._notify()
        return hosts

    def adopt_placement(self, kernel_id: KernelId, hosts: Iterable[HostId], gpus: int) -> None:
        """A kernel placed before this scheduler started (a restarted gateway took it
        over): its replicas are on ``hosts``, ``gpus`` subscribed on each. A host named
        twice (a hand-edited state file) counts once."""
        distinct = tuple(dict.fromkeys(hosts))
        self._set_placement(kernel_id, distinct, gpus)
        self._notify()

    def replica_moved(self, kernel_id: KernelId, old: HostId, new: HostId) -> None:
        """A replica of the kernel was replaced from host ``old`` to ``new``: so is its
        subscription. (What it held on ``old`` is freed by :meth:`replica_gone`.)"""
        hosts = self.model.replica_hosts(kernel_id)
        if old not in hosts:
            return
        if new in hosts:
            log.warning("kernel %s: a replica moved to %s, which holds one already", kernel_id, new)
            return
        self.model.move(kernel_id, old, new)
        log.info("kernel %s: replica moved from %s to %s", kernel_id, old, new)
        self._notify()

    def _set_placement(self, kernel_id: KernelId, hosts: tuple[HostId, ...], gpus: int) -> None:
        """The kernel's replicas are on these hosts, subscribing ``gpus`` on each (in place of
        an earlier placement: a gateway taking the kernel over adopts it again)."""
        self._forget_placement(kernel_id)
        self.model.place(kernel_id, hosts, gpus)

    def _forget_placement(self, kernel_id: KernelId) -> None:
        if self.model.placed(kernel_id):
            self.model.forget(kernel_id)

    def hold(self, host: HostId, gpus: int) -> MoveHold:
        """Count ``gpus`` GPUs of ``host`` as committed while a cell's replica migrates there.

        The simulator commits a migrating cell's GPUs when it decides the move; so does
        the view here, in the same step as the decision (:meth:`acquire` holds them before
        it calls ``on_migrate``), so that neither another cell's decision nor the autoscaler
        (which drains idle hosts) takes the host from under the move.
        """
        self.model.hold(host, gpus)
        self._notify()

        def release() -> None:
            self.model.hold(host, -gpus)
            self._notify()

        return MoveHold(host, gpus, release=release)

    # --- cells -----------------------------------------------------------------------

    async def acquire(
        self,
        kernel_id: KernelId,
        exec_index: int,
        replicas: Mapping[int, HostId],
        *,
        last_executor: int | None,
        gpus: int,
        on_wait: WaitCallback | None = None,
        on_migrate: MigrateCallback | None = None,
        user: str = "",
        arrived: float | None = None,
        held: MoveHold | None = None,
    ) -> Grant:
        """Choose the executor of a cell and pre-commit its GPUs on that replica's host.

        ``replicas`` maps the live replicas' ids to their hosts. The choice is
        :meth:`ClusterDecisions.cell`'s: the last executor if its host can commit
        ``gpus`` now, else another replica's (:func:`~nbos.scaling.executor.execute_or_wait`'s
        order), else the cell waits (``on_wait`` gets the reason; so does :meth:`waiting`). While it
        waits because moving a replica would let it run, ``on_migrate`` gets the
        :class:`MigrationPlan` (carrying it out is the caller's), with the target's GPUs
        held from the decision on (a :class:`MoveHold` it must release); a later, different
        plan only once that hold is released. ``user`` owns the
        kernel (``""``: nobody): its GPUs count against that user's quota, and a cell
        that would borrow beyond it waits while another user's within-quota cell waits
        (the reason names both users). ``arrived``: when the cell's request reached the
        kernel (wall-clock), for its delay's split (:meth:`Ledger.cell_waited`). ``held``:
        GPUs held for this cell (its move's target, once the move is over), counted as
        committed until its own decision takes their place, so that no other cell plans
        on them in between (the caller releases them if this raises first). Raises
        :class:`InsufficientGpusError` at once if no known host has ``gpus`` GPUs,
        :class:`GpuError` for a negative count and :class:`QuorumLostError` for no
        replicas.
        """
        check_cell_gpus(gpus, self.view().largest_gpus())
        if not replicas:
            raise QuorumLostError(
                f"kernel {kernel_id} has no live replica to run cell {exec_index}"
            )
        self._agents.kernel_lives_on(kernel_id, replicas.values())
        self._users[kernel_id] = user
        staying = self._decisions.off_draining(tuple(replicas.values()), self.model.is_draining)
        replicas = {n: h for n, h in replicas.items() if h in staying}
        self.ledger.cell_ready(kernel_id, exec_index, gpus, arrived)
        if gpus == 0:
            return self._without_gpus(kernel_id, exec_index, replicas, last_executor)
        key = frozenset(replicas.values())
        queue = self._queues.setdefault(key, {})
        ticket = object()
        # A cell with GPUs held for it had them already: it goes before the cells that wait
        # (behind them it would wait for the GPUs it holds).
        queue[ticket] = Waiter(user, gpus, -1 if held is not None else next(self._arrivals))
        shown: str | None = None
        proposal: tuple[MigrationPlan, MoveHold] | None = None
        # When the cell began to wait (wall clock, and the scale-out clock's reading).
        waited_from: tuple[float, float] | None = None
        try:
            while True:
                version = self._version
                ahead = self._ahead(queue, ticket)
                if ahead is not None:
                    outcome, starved = ahead
                else:
                    decided = await self._try(
                        kernel_id, exec_index, replicas, last_executor, gpus, held=held
                    )
                    if isinstance(decided, Grant):
                        return decided
                    if isinstance(decided, MigrationPlan):
                        proposal = await self._propose(decided, gpus, on_migrate, proposal)
                    outcome, starved = _wait_reason(decided, gpus), isinstance(decided, Wait)
                (self._starved.add if starved else self._starved.discard)((kernel_id, exec_index))
                if outcome != shown:
                    shown = self._waiting[(kernel_id, exec_index)] = outcome
                    log.info("kernel %s cell %d: %s", kernel_id, exec_index, outcome)
                    if on_wait is not None:
                        await on_wait(outcome)
                if waited_from is None:
                    waited_from = (self.ledger.now(), self.scale_outs.reading())
                await self._wait_change(version)
        finally:
            if waited_from is not None:
                began, scaling = waited_from
                self.ledger.cell_waited(
                    kernel_id,
                    exec_index,
                    self.ledger.now() - began,
                    self.scale_outs.reading() - scaling,
                )
            del queue[ticket]
            if not queue:
                del self._queues[key]
            self._not_waiting((kernel_id, exec_index))

    async def _propose(
        self,
        plan: MigrationPlan,
        gpus: int,
        on_migrate: MigrateCallback | None,
        last: tuple[MigrationPlan, MoveHold] | None,
    ) -> tuple[MigrationPlan, MoveHold] | None:
        """Hand a waiting cell's move to ``on_migrate`` with its target's GPUs held, unless
        it is the move proposed ``last`` or that one's GPUs are still held (the caller is
        carrying it out: a second move would hold a second host); the proposal now out."""
        if on_migrate is None:
            return last
        if last is not None and (last[0] == plan or not last[1].released):
            return last
        proposal = plan, self.hold(plan.target, gpus)
        try:
            await on_migrate(*proposal)
        except BaseException:
            proposal[1].release()  # the caller never took the move
            raise
        # The hold changed the view: a caller that ends the wait does so before the cell
        # decides again and finds the host it holds taken.
        await anyio.lowlevel.checkpoint()
        return proposal

    def _without_gpus(
        self,
        kernel_id: KernelId,
        exec_index: int,
        replicas: Mapping[int, HostId],
        last_executor: int | None,
    ) -> Grant:
        """The grant of a cell that asks for no GPUs: nothing to pre-commit, but the executor
        is still the decision's, which looks up the replicas' hosts alone in the model's
        view: such a cell never waits nor migrates, and its cost must not grow with the
        cluster."""
        order = [replicas[r] for r in sorted(replicas)]
        last = replicas.get(last_executor) if last_executor is not None else None
        choice = self._decisions.cell(self.view(), kernel_id, order, last, 0)
        host = choice.host if isinstance(choice, Execute) else replicas[min(replicas)]
        replica = self._replica_on(host, replicas, last_executor)
        self.ledger.cell_started(kernel_id, exec_index)
        _count_delay(self.ledger.cell(kernel_id, exec_index))
        return Grant(kernel_id, exec_index, replica, host, (), "")

    def _not_waiting(self, cell: tuple[KernelId, int]) -> None:
        """The cell waits no more (it got its GPUs, or gave up)."""
        self._waiting.pop(cell, None)
        self._starved.discard(cell)
        self._notify()

    def _ahead(self, queue: Mapping[object, Waiter], ticket: object) -> tuple[str, bool] | None:
        """Why the cell of ``ticket`` may not try for GPUs now (``None``: it may), and whether
        that is a wait for capacity: it would borrow while another user's within-quota cell
        waits (it is, as in the simulator), or earlier cells of its set of replica hosts go
        first (it is not: those decide for the hosts)."""
        waiter = queue[ticket]
        if self._fair is None:
            before = sum(1 for w in queue.values() if w.arrival < waiter.arrival)
        else:
            held = self.user_gpus()
            everyone = [w for q in self._queues.values() for w in q.values()]
            decided = self._fair.decide(waiter, everyone, held)
            if isinstance(decided, Yield):
                return decided.reason, True
            mine = self._fair.order(waiter, held)
            before = sum(1 for w in queue.values() if self._fair.order(w, held) < mine)
        if before:
            return f"waiting for {waiter.gpus} GPUs behind {before} earlier cells", False
        return None

    async def committed(self, grant: Grant) -> Grant:
        """The cell of ``grant`` started: commit its reservation and return the grant.

        If the agent lost the pre-commit (it expired, or the agent restarted), the
        commit takes fresh devices and the returned grant names them. Raises
        :class:`UnknownReservationError` for a released grant, :class:`HostUnreachableError`
        when the agent does not answer and :class:`GpuError` (or
        :class:`InsufficientGpusError`) when it refuses; the caller must then
        not run the cell, and release the grant.
        """
        res = grant.reservation_id
        if not res or res in self._hosts.committed:
            return self._hosts.grant(res) or grant
        if self._hosts.grant(res) is None:
            raise UnknownReservationError(res, "released")
        host = self._hosts[grant.host]
        n = len(grant.devices)
        first = self._evict_first(grant.host)
        reply = await self._agents.call(
            host, lambda rid: GpuCommit(rid, res, grant.kernel_id, n, evict_first=first)
        )
        if isinstance(reply, GpuGranted) and reply.reservation.state == "committed":
            devices = tuple(reply.reservation.devices)
            if devices != grant.devices:
                log.warning(
                    "reservation %s re-committed on devices %s, not %s", res, devices, grant.devices
                )
            if self._hosts.grant(res) is not None:
                grant = attrs.evolve(grant, devices=devices)
                self._hosts.keep(grant)
                self._hosts.committed.add(res)
                self.ledger.cell_started(grant.kernel_id, grant.exec_index)
                _count_delay(self.ledger.cell(grant.kernel_id, grant.exec_index))
            return grant
        raise _refusal_error(reply, n, host.host_id)

    async def release(self, grant: Grant, *, resident: bool = False) -> None:
        """Free the GPUs of ``grant``; idempotent, and never raises for a suspected agent.

        ``resident`` leaves the kernel's tensors on the devices until another
        kernel needs them (lazy eviction).
        """
        res = grant.reservation_id
        if not res or self._hosts.drop(res) is None:
            return
        if res in self._hosts.committed:
            self.ledger.cell_ended(grant.kernel_id, grant.exec_index)
        self._hosts.committed.discard(res)
        await self._agents.release(grant.host, res, resident)

    @asynccontextmanager
    async def cell(
        self,
        kernel_id: KernelId,
        exec_index: int,
        replicas: Mapping[int, HostId],
        *,
        last_executor: int | None,
        gpus: int,
        on_wait: WaitCallback | None = None,
        user: str = "",
    ) -> AsyncIterator[CellLease]:
        """:meth:`acquire` a grant for the block and :meth:`release` it however the block ends.

        The release runs shielded from cancellation, so an interrupted or timed-out
        cell still returns its GPUs.
        """
        grant = await self.acquire(
            kernel_id,
            exec_index,
            replicas,
            last_executor=last_executor,
            gpus=gpus,
            on_wait=on_wait,
            user=user,
        )
        lease = CellLease(grant, scheduler=self)
        try:
            yield lease
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(lease.grant, resident=lease.resident)

    async def kernel_gone(self, kernel_id: KernelId) -> None:
        """The kernel was shut down or died: free its GPUs and residency on every host."""
        self._forget_placement(kernel_id)
        self._users.pop(kernel_id, None)
        async with anyio.create_task_group() as tg:
            for host in list(self._hosts.records()):
                tg.start_soon(self.replica_gone, kernel_id, host.host_id)
        log.info("kernel %s gone: its GPUs are released", kernel_id)

    async def replica_gone(self, kernel_id: KernelId, host_id: HostId) -> None:
        """The kernel's replica on ``host_id`` died or was removed: free what it held there.

        Its grants there are dropped and the agent frees its reservations and
        resident marks (the tensors died with the process), so no later
        allocation waits for an eviction that nobody can do. A suspected
        agent is told when it reports again.
        """
        gone = [(r, g) for r, g in self._hosts.on(host_id).items() if g.kernel_id == kernel_id]
        for res, grant in gone:
            self._hosts.drop(res)
            self._hosts.committed.discard(res)
            self.ledger.cell_ended(kernel_id, grant.exec_index)
        await self._agents.release_kernel(host_id, kernel_id)
        self._notify()

    # --- choosing and pre-committing -------------------------------------------------

    async def _try(
        self,
        kernel_id: KernelId,
        exec_index: int,
        replicas: Mapping[int, HostId],
        last_executor: int | None,
        gpus: int,
        *,
        held: MoveHold | None = None,
    ) -> Grant | Wait | MigrationPlan:
        """One attempt over the replicas' hosts: a grant, or the decision to wait or migrate.

        The chosen host's GPUs are held (:meth:`hold`) from the decision until its
        pre-commit is answered, as the simulator commits them when it decides: otherwise
        another cell deciding meanwhile sees them idle and plans a move onto them. ``held``
        (the cell's own, :meth:`acquire`) gives way to the decision in the same step."""
        order = [replicas[r] for r in sorted(replicas)]
        last_host = replicas.get(last_executor) if last_executor is not None else None
        refused: set[HostId] = set()
        while True:
            down = refused | {h for h in order if not self._hosts.live(h)}
            if held is not None:
                held.release()
            try:
                choice = self._decisions.cell(
                    self.view(), kernel_id, order, last_host, gpus, down=down
                )
            except InsufficientGpusError:
                return Wait(f"waiting for {gpus} GPUs: no host has that many")
            except PlacementError as exc:
                return Wait(f"waiting for {gpus} GPUs: no migration ({exc})")
            if not isinstance(choice, Execute):
                return choice
            replica = self._replica_on(choice.host, replicas, last_executor)
            deciding = self.hold(choice.host, gpus)
            try:
                grant = await self._precommit(kernel_id, exec_index, replica, choice.host, gpus)
            finally:
                deciding.release()
            if grant is not None:
                return grant
            refused.add(choice.host)

    def _evict_first(self, host_id: HostId) -> list[str]:
        """The kernels with replicas on the host whose resident GPU memory the fair share
        has evicted first (their users are over quota); none without quotas."""
        if self._fair is None or host_id not in self.model.hosts:
            return []
        holders = {k: self._users.get(k, "") for k in self.model.kernels_on(host_id)}
        return sorted(self._fair.evict_first(holders, self.user_gpus()))

    @staticmethod
    def _replica_on(host: HostId, replicas: Mapping[int, HostId], last: int | None) -> int:
        if last is not None and replicas.get(last) == host:
            return last
        return min(r for r, h in replicas.items() if h == host)

    async def _precommit(
        self, kernel_id: KernelId, exec_index: int, replica: int, host_id: HostId, gpus: int
    ) -> Grant | None:
        host = self._hosts[host_id]
        res = f"{kernel_id}/{exec_index}/{uuid.uuid4().hex[:12]}"
        first = self._evict_first(host_id)
        try:
            reply = await self._agents.call(
                host, lambda rid: GpuPrecommit(rid, res, kernel_id, gpus, evict_first=first)
            )
        except HostUnreachableError:
            return None
        except BaseException:
            # Cancelled while asking: the agent may have granted it; give it back.
            self._agents.release_soon(host, res)
            raise
        if isinstance(reply, GpuGranted) and reply.reservation.state in (
            "precommitted",
            "committed",
        ):
            grant = Grant(
                kernel_id, exec_index, replica, host_id, tuple(reply.reservation.devices), res
            )
            host.reported[res] = reply.reservation
            self._hosts.keep(grant)
            return grant
        if isinstance(reply, GpuRefused):
            log.info(
                "host %s refused %d GPUs for kernel %s: %s", host_id, gpus, kernel_id, reply.message
            )
        else:
            log.warning("host %s answered a pre-commit with %s", host_id, type(reply).__name__)
        self._agents.refresh_soon(host)
        return None

    # --- wake-ups --------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Goes up whenever the cluster changes (hosts, placements, grants)."""
        return self._version

    async def changed(self, since: int) -> None:
        """Return once the cluster changed after :attr:`version` was ``since``, or after the
        poll interval (a view's figures also drift without an event)."""
        await self._wait_change(since)

    def _notify(self) -> None:
        live = [h for h in self._hosts.records() if not h.suspected]
        self.ledger.hosts_changed(len(live), sum(len(h.devices) for h in live))
        self.model.observe_demand()
        self._version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_change(self, version: int) -> None:
        if self._version != version:
            return
        with anyio.move_on_after(self._poll):
            await self._changed.wait()

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)


def _count_delay(cell: CellUsage | None) -> None:
    """Tell the metrics where a started cell's delay went, cause by cause."""
    split = cell.split() if cell is not None else None
    if split is None:
        return
    for cause, seconds in zip(CAUSES, split.values(), strict=True):
        events().cell_delayed(cause, seconds)


def _wait_reason(decided: Wait | MigrationPlan, gpus: int) -> str:
    if isinstance(decided, Wait):
        return decided.reason
    return (
        f"waiting for {gpus} GPUs: no replica's host has them idle "
        f"(moving the replica on {decided.source} to {decided.target} can make room)"
    )


def _refusal_error(reply: object, n: int, host: HostId) -> GpuError:
    if isinstance(reply, GpuRefused):
        log.info("host %s refused a commit: %s", host, reply.message)
        if reply.reason == "insufficient":
            return InsufficientGpusError(n, reply.idle, f"host {host}")
        if reply.reason in ("unknown", "expired"):
            return UnknownReservationError(reply.message, reply.reason)
        return GpuError(f"host {host} refused: {reply.message}")
    log.warning("host %s answered a commit with %r", host, reply)
    return GpuError(f"host {host} answered a commit with {type(reply).__name__}")
