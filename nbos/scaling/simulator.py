"""A discrete-event simulator that replays a session trace against the real scheduling code.

Every decision is made by one :class:`~nbos.scaling.decisions.ClusterDecisions`,
the object the gateway's scheduler uses too: the placement policy loaded by
name through :func:`~nbos.scaling.load_policy` (so a user's policy registered by
entry point works here unchanged), the executor choice and migration plan, and
the :class:`~nbos.scaling.autoscaler.Autoscaler`. The cluster is a
:class:`~nbos.scaling.model.ClusterModel` (the class the gateway's scheduler keeps too)
kept up to date event by event, with a real :class:`~nbos.gpu.GpuPool` per host driven
by the simulated clock. Two modes:

``"nbos"``
    Each session's kernel has ``replicas_per_kernel`` replicas placed by the
    policy (subscription-ratio admission, so hosts are oversubscribed). A cell
    commits its GPUs on the replica host the decision names, only while it runs;
    when no replica's host can, one replica migrates (taking ``migration_time``)
    or the cell waits.
``"reservation"``
    The baseline: a session commits its GPUs on one host (the policy's
    ``migration_target``: a host that can commit them now) for its whole life,
    and its cells run at once.

Waiting work is woken only by the events that can unblock it: waiting cells when
GPUs are released or hosts join; kernels not yet placed when a session ends, a
host joins or (nbos mode, where admission follows the drifting demand ratio) at
every tick. A cheap test on the model's counts of hosts by idle GPUs skips work
that no host could take, so a cluster at its host ceiling costs little per event.

Both modes run the autoscaler (unless ``SimConfig.autoscaler`` is ``None``)
every ``tick`` seconds. Events at equal times run in a fixed order (ends,
hosts joining, session starts, cells, stops, ticks; then the order they were
scheduled), so a run is deterministic given the trace, the config and a
deterministic policy (seed :class:`~nbos.scaling.RandomPolicy` via
``policy_kwargs``). The run keeps the gateway's :class:`~nbos.scaling.ledger.Ledger` on
its clock and reports through :mod:`nbos.scaling.results`, as ``nbos replay`` does;
metrics are described in ``docs/simulator.md``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

from nbos.core.errors import (
    ConfigError,
    InsufficientGpusError,
    PlacementError,
    PolicyContractError,
    ScalingError,
)
from nbos.core.ids import HostId, KernelId
from nbos.gpu.pool import GpuPool
from nbos.scaling.autoscaler import Autoscaler, AutoscalerConfig, ScaleIn, ScaleOut
from nbos.scaling.decisions import ClusterDecisions
from nbos.scaling.delays import (
    DelaySplit,
    ScaleOutClock,
    carried_over,
    delay_at_1x,
    split_wait,
)
from nbos.scaling.executor import Execute, Wait
from nbos.scaling.fair_share import FairShare, UserGpus, Waiter, Yield
from nbos.scaling.fairness import UserCell
from nbos.scaling.ledger import Ledger
from nbos.scaling.limits import HostLimits
from nbos.scaling.migration import MigrationPlan
from nbos.scaling.model import ClusterModel
from nbos.scaling.results import Run, Sample, SimResult, sim_result
from nbos.scaling.timings import MEASURED, Timings
from nbos.scaling.trace import Cell, Session, Trace, validated

log = logging.getLogger(__name__)

Mode = Literal["nbos", "reservation"]
MODES: tuple[Mode, ...] = ("nbos", "reservation")

# Order of simultaneous events: what frees GPUs first, what looks at the result last.
_END, _HOST, _START, _SUBMIT, _STOP, _TICK, _CLOSE = range(7)


def _check_config(instance: SimConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    limits: dict[str, tuple[float, str]] = {
        "hosts": (0, "an integer >= 0"),
        "gpus_per_host": (1, "an integer >= 1"),
        "replicas_per_kernel": (1, "an integer >= 1"),
        "tick": (1e-9, "a positive number of seconds"),
        "host_startup": (0, "a number of seconds >= 0"),
        "migration_time": (0, "a number of seconds >= 0"),
        "gpu_commit": (0, "a number of seconds >= 0"),
        "kernel_start": (0, "a number of seconds >= 0"),
        "interactive_within": (0, "a number of seconds >= 0"),
        "speedup": (1e-9, "a positive number"),
        "overrun_limit": (0, "a number of seconds >= 0"),
    }
    low, expected = limits[attribute.name]
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= low):
        raise _refused(ConfigError(attribute.name, value, expected))


def _check_mode(instance: SimConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in MODES:
        raise _refused(ConfigError("mode", value, f"one of {', '.join(MODES)}"))


@attrs.frozen
class SimConfig:
    """The simulated cluster and how it is run; :class:`ConfigError` for bad values."""

    hosts: int = attrs.field(default=4, validator=_check_config)
    gpus_per_host: int = attrs.field(default=8, validator=_check_config)
    mode: Mode = attrs.field(default="nbos", validator=_check_mode)
    policy: str = "least-loaded"
    #: Keyword arguments for the policy's factory (e.g. ``{"seed": 1}`` for ``random``).
    policy_kwargs: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    replicas_per_kernel: int = attrs.field(default=3, validator=_check_config)
    #: ``None``: a fixed cluster of ``hosts`` hosts.
    autoscaler: AutoscalerConfig | None = attrs.field(factory=AutoscalerConfig)
    #: Seconds between autoscaler decisions (and retries of pending placements and drains).
    tick: float = attrs.field(default=60.0, validator=_check_config)
    #: Seconds from a scale-out decision until the new hosts can take replicas.
    host_startup: float = attrs.field(default=MEASURED.host_startup, validator=_check_config)
    #: Seconds a replica migration delays the cell that caused it.
    migration_time: float = attrs.field(default=MEASURED.migration_time, validator=_check_config)
    #: Seconds from a cell's GPUs being granted until it runs (pre-commit and commit).
    gpu_commit: float = attrs.field(default=MEASURED.gpu_commit, validator=_check_config)
    #: Seconds from a kernel's placement until it runs cells.
    kernel_start: float = attrs.field(default=MEASURED.kernel_start, validator=_check_config)
    #: A cell is *interactive* if it starts within this many seconds of being ready.
    interactive_within: float = attrs.field(default=1.0, validator=_check_config)
    #: The run stops taking work this long after the trace ends: cells not started then
    #: are reported as never run (running ones finish).
    overrun_limit: float = attrs.field(default=6 * 3600.0, validator=_check_config)
    #: What one host takes (replicas; a simulated host's free memory is not known).
    host_limits: HostLimits = attrs.field(factory=HostLimits)
    #: The users' GPU quotas, kept to in nbos mode (the baseline reserves per session) and
    #: the fair shares of both modes' reports; ``None``: none, cells wait in arrival order.
    fair_share: FairShare | None = attrs.field(default=None, hash=False)
    #: nbos mode: every tick, copy a replica of each idle kernel whose replicas' hosts could
    #: not commit its GPUs to a host that could (``ClusterDecisions.precopy``), so that its
    #: next cell need not wait for that migration; costs the move (``migration_time``).
    precopy: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: The simulation stands for a run this many times faster than the trace, whose own
    #: work took real seconds (:meth:`replaying`): its delays at 1x count that work in
    #: real seconds (:func:`~nbos.scaling.delays.delay_at_1x`). 1: the trace's own speed.
    speedup: float = attrs.field(default=1.0, validator=_check_config)

    def timed(self, timings: Timings) -> SimConfig:
        """This config assuming ``timings`` (``nbos calibrate``'s) for nbos's own work."""
        return attrs.evolve(self, **attrs.asdict(timings))

    def replaying(self, timings: Timings, speedup: float) -> SimConfig:
        """This config as the cluster ``nbos replay --speedup`` drives: nbos's own work
        (``timings``) takes real seconds, ``speedup`` trace seconds each, except a cell's
        commit (hundredths of a second, within what the replay counts as its own overhead);
        its delays at 1x count that work in real seconds again."""
        scaled = attrs.evolve(timings.scaled(speedup), gpu_commit=timings.gpu_commit)
        return attrs.evolve(self.timed(scaled), speedup=speedup)


def simulate(
    trace: Trace,
    config: SimConfig | None = None,
    *,
    progress: Callable[[float], None] | None = None,
    decisions: ClusterDecisions | None = None,
    model: ClusterModel | None = None,
) -> SimResult:
    """Replay ``trace`` on the cluster ``config`` describes.

    ``progress``, if given, is called with the simulated time (seconds) at every
    tick. ``decisions`` replaces those ``config`` names (its policy, policy
    arguments and autoscaler), and ``model`` the empty :class:`ClusterModel` the run
    starts from: for code that watches every decision and every view of the cluster,
    as ``bench/decide.py`` times them.

    Raises :class:`ScalingError` for a malformed trace, one with a session asking for
    more GPUs than a host has, or a ``model`` that is not empty;
    :class:`~nbos.core.errors.PluginError` for a policy that cannot be loaded, and
    :class:`~nbos.core.errors.PolicyContractError` if the policy answers with hosts
    it may not choose.
    """
    config = config if config is not None else SimConfig()
    trace = validated(trace)
    too_big = [s.id for s in trace.sessions if s.gpus > config.gpus_per_host]
    if too_big:
        message = f"sessions {too_big} ask for more than the {config.gpus_per_host} GPUs of a host"
        log.warning("%s", message)
        raise ScalingError(message)
    if decisions is None:
        autoscaler = Autoscaler(config.autoscaler) if config.autoscaler else None
        decisions = ClusterDecisions.load(
            config.policy, config.replicas_per_kernel, autoscaler, **config.policy_kwargs
        )
    return _Simulation(trace, config, decisions, progress, model).run()


# --- state -----------------------------------------------------------------------------


@attrs.define
class _Kernel:
    session: Session
    kernel_id: KernelId
    last: HostId | None = None
    #: Submitted cells not finished, each with when it would start on an unlimited cluster.
    queue: deque[tuple[Cell, float]] = attrs.field(factory=deque)
    #: When the last submitted cell would end on an unlimited cluster.
    ideal_end: float = 0.0
    executing_on: HostId | None = None
    placed: bool = False
    stop_requested: bool = False
    finished: bool = False
    #: The lifetime reservation in reservation mode.
    reservation: str | None = None
    reservations: int = 0
    #: When the head cell began to ask for GPUs (an arrival number), while it asks.
    arrival: int | None = None
    #: When the kernel's last cell ended.
    last_end: float = 0.0
    #: The scale-out clock's reading when the head cell became ready (its wait's start).
    ready_mark: float = 0.0
    #: When the kernel, placed, has started (``kernel_start`` later) and runs cells.
    ready_at: float = 0.0
    #: The last started cell's end on an unlimited cluster and its delay at 1x: what its
    #: lateness carries over to the next cell at 1x (:func:`delay_at_1x`).
    carry_1x: tuple[float, float] = (-math.inf, 0.0)
    #: The replica being copied ahead of the kernel's next cell (``SimConfig.precopy``).
    copying: MigrationPlan | None = None
    #: Whether a replica was copied since the kernel's last cell (once per idle spell).
    copied: bool = False

    @property
    def user(self) -> str:
        return self.session.owner

    def next_reservation(self) -> str:
        self.reservations += 1
        return f"{self.kernel_id}#{self.reservations}"

    def head_gpus(self) -> int:
        return self.session.cell_gpus(self.queue[0][0])


class _Simulation:
    """The event loop over a :class:`ClusterModel`; every decision is ``decisions``'."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        decisions: ClusterDecisions,
        progress: Callable[[float], None] | None = None,
        model: ClusterModel | None = None,
    ) -> None:
        self._trace = trace
        self._cfg = config
        self.decisions = decisions
        self._progress = progress
        self.model = (
            model
            if model is not None
            else ClusterModel(config.replicas_per_kernel, config.host_limits)
        )
        if self.model.hosts:
            message = "the simulation's cluster model must start empty"
            log.warning("%s", message)
            raise ScalingError(message)
        self.pools: dict[HostId, GpuPool] = {}
        self._now = 0.0
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = 0
        self._host_serial = 0
        self._kernels: dict[KernelId, _Kernel] = {}
        # Both FIFO by insertion: kernels not placed yet, kernels whose head cell waits.
        self._pending: dict[KernelId, _Kernel] = {}
        self._waiting: dict[KernelId, _Kernel] = {}
        self._unfinished = len(trace.sessions)
        self._provisioning = 0
        # The replica moving off each draining host now (the drain moves one at a time).
        self._moving_off: dict[HostId, MigrationPlan] = {}
        self._closed = False
        self._warned_ceiling = False
        # GPUs of running cells (a migration commits them before its cell runs), and the
        # GPU-seconds of the cells started: the trace's work, which no ledger of a cluster holds.
        self._gpus_busy = 0
        self._busy_gpu_s = 0.0
        self._delays: list[float] = []
        self._splits: list[DelaySplit] = []
        self._delays_1x: list[float] = []
        # How long hosts were being added: the scale-out part of a cell's wait.
        self._scale_outs = ScaleOutClock(lambda: self._now)
        self._user_cells: list[UserCell] = []
        self._fair = config.fair_share
        self._user_gpus = UserGpus()
        self._arrivals = itertools.count()
        self._samples: list[Sample] = []
        for _ in range(config.hosts):
            self._new_host()
        self.ledger = Ledger(lambda: self._now, len(self.pools), self.model.capacity)

    # --- the loop ------------------------------------------------------------------

    def run(self) -> SimResult:
        for s in self._trace.sessions:
            self._schedule_session(s)
        self._at(0.0, _TICK, self._tick)
        self._at(self._trace.end + self._cfg.overrun_limit, _CLOSE, self._close)
        while self._events:
            when, order, _, action = heapq.heappop(self._events)
            if order >= _TICK and (self._closed or not self._unfinished):
                continue  # the run ends with its last session (or the overrun limit)
            self._now = when
            action()
            if self._cfg.mode == "nbos":
                self.model.observe_demand()
        self._sample()
        return self._result()

    def _at(self, when: float, order: int, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, order, self._seq, action))

    def _schedule_session(self, s: Session) -> None:
        kernel = _Kernel(s, KernelId(s.id))
        self._kernels[kernel.kernel_id] = kernel
        self._at(s.start, _START, lambda: self._start(kernel))
        for cell in s.cells:
            self._at(cell.start, _SUBMIT, functools.partial(self._submit, kernel, cell))
        self._at(s.stop, _STOP, lambda: self._stop(kernel))

    def _close(self) -> None:
        """The overrun limit: cells not started are dropped (never run), running ones finish,
        and every session ends once it runs nothing, so it holds nothing any longer."""
        dropped = 0
        self._closed = True
        for kernel in self._kernels.values():
            keep = 1 if kernel.executing_on is not None else 0
            dropped += len(kernel.queue) - keep
            while len(kernel.queue) > keep:
                kernel.queue.pop()
        self._waiting.clear()
        log.warning(
            "t=%.0f: overrun limit reached %.0f s after the trace ended; "
            "%d cells not started are reported as never run",
            self._now,
            self._cfg.overrun_limit,
            dropped,
        )
        for kernel in list(self._kernels.values()):
            self._maybe_finish(kernel)

    # --- sessions ------------------------------------------------------------------

    def _start(self, kernel: _Kernel) -> None:
        self._pending[kernel.kernel_id] = kernel
        self._place_kernel(kernel)

    def _place_pending(self) -> None:
        """Try to place waiting kernels, first come first served."""
        for kernel in list(self._pending.values()):
            # A nested call (a kernel finishing frees room) may have placed it already.
            if kernel.kernel_id in self._pending:
                self._place_kernel(kernel)

    def _place_kernel(self, kernel: _Kernel) -> None:
        if self._place(kernel):
            del self._pending[kernel.kernel_id]
            kernel.ready_at = self._now + self._cfg.kernel_start
            if kernel.ready_at > self._now:
                self._at(kernel.ready_at, _START, lambda: self._try_run(kernel))
            self._try_run(kernel)
            self._maybe_finish(kernel)

    def _place(self, kernel: _Kernel) -> bool:
        gpus = kernel.session.gpus
        if self._closed:
            return False
        if self._cfg.mode == "reservation":
            # The policy contract: a target can commit the GPUs now. No host can: no call.
            if not self.model.could_commit(gpus, schedulable=True):
                return False
            target = self.decisions.reserve(self.model.view(), kernel.kernel_id, gpus)
            if target is None:
                return False
            kernel.reservation = kernel.next_reservation()
            self._commit(target, kernel, gpus, kernel.reservation)
            hosts: tuple[HostId, ...] = (target,)
        else:
            if self.model.schedulable_hosts < self._cfg.replicas_per_kernel:
                return False
            try:
                hosts = self.decisions.place(self.model.view(), kernel.kernel_id, gpus)
            except PolicyContractError:
                raise
            except PlacementError as exc:
                log.debug("t=%.0f: %s", self._now, exc)
                return False
        self.model.place(kernel.kernel_id, hosts, gpus)
        kernel.placed = True
        return True

    def _stop(self, kernel: _Kernel) -> None:
        kernel.stop_requested = True
        self._maybe_finish(kernel)

    def _maybe_finish(self, kernel: _Kernel) -> None:
        """End a stopped session once its queued cells ran (a never-placed one just leaves)."""
        if (
            kernel.finished
            or not kernel.stop_requested
            or kernel.queue
            or kernel.executing_on is not None
        ):
            return
        kernel.finished = True
        self._pending.pop(kernel.kernel_id, None)
        self._unfinished -= 1
        if not kernel.placed:
            return
        for h in self.model.replica_hosts(kernel.kernel_id):
            if kernel.reservation is not None:
                self._release(h, kernel.reservation)
            self.pools[h].release_kernel(kernel.kernel_id)
        self.model.forget(kernel.kernel_id)
        kernel.placed = False
        # Subscriptions (and, reserving, GPUs) freed: room for kernels not placed yet.
        self._place_pending()

    # --- cells ---------------------------------------------------------------------

    def _submit(self, kernel: _Kernel, cell: Cell) -> None:
        # Cells of one kernel run one after another, so on an unlimited cluster a cell
        # starts when it is submitted or when the previous one ends, whichever is later.
        ideal_start = max(self._now, kernel.ideal_end)
        kernel.ideal_end = ideal_start + cell.duration
        kernel.queue.append((cell, ideal_start))
        if len(kernel.queue) == 1:
            kernel.ready_mark = self._scale_outs.reading()
        self._try_run(kernel)

    def _try_run(self, kernel: _Kernel) -> None:
        """Start the kernel's next cell if it can start now; else it waits."""
        if self._closed or not kernel.placed or kernel.executing_on is not None or not kernel.queue:
            return
        if self._now < kernel.ready_at:
            return  # the kernel is starting: its cells run once it has (an event then)
        hosts = self.model.replica_hosts(kernel.kernel_id)
        if self._cfg.mode == "reservation":
            self._begin(kernel, hosts[0], self._now, None)
            return
        staying = self.decisions.off_draining(hosts, self.model.is_draining)
        gpus = kernel.head_gpus()
        if kernel.arrival is None:
            kernel.arrival = next(self._arrivals)
        if self._yields(kernel, gpus):
            self._waiting.setdefault(kernel.kernel_id, kernel)
            return
        try:
            decision = self.decisions.cell(
                self.model.view(), kernel.kernel_id, staying, kernel.last, gpus
            )
        except InsufficientGpusError:
            decision = Wait("no host up")  # only while no host is up; hosts are all large enough
        if isinstance(decision, Execute):
            reservation = self._commit(decision.host, kernel, gpus, kernel.next_reservation())
            self._user_gpus.add(kernel.user, gpus)
            self._begin(kernel, decision.host, self._now + self._cfg.gpu_commit, reservation)
        elif isinstance(decision, MigrationPlan):
            self._move(kernel, decision.source, decision.target)
            self.ledger.migrations += 1
            reservation = self._commit(decision.target, kernel, gpus, kernel.next_reservation())
            self._user_gpus.add(kernel.user, gpus)
            ready = self._now + self._cfg.migration_time + self._cfg.gpu_commit
            self._begin(kernel, decision.target, ready, reservation)
        else:
            self._waiting.setdefault(kernel.kernel_id, kernel)

    def _yields(self, kernel: _Kernel, gpus: int) -> bool:
        """Whether the fair share has the kernel's head cell (borrowing) wait for another
        user's within-quota cell: the gateway scheduler's rule, by the same decision."""
        if self._fair is None or not gpus:
            return False
        assert kernel.arrival is not None
        waiter = Waiter(kernel.user, gpus, kernel.arrival)
        waiting = [self._waiter(k) for k in self._waiting.values()]
        return isinstance(self._fair.decide(waiter, waiting, self._user_gpus.view()), Yield)

    @staticmethod
    def _waiter(kernel: _Kernel) -> Waiter:
        assert kernel.arrival is not None
        return Waiter(kernel.user, kernel.head_gpus(), kernel.arrival)

    def _could_run(self, kernel: _Kernel) -> bool:
        """Cheap necessary condition for a waiting cell: a replica host, or a schedulable
        host it could migrate to, has its GPUs idle."""
        gpus = kernel.head_gpus()
        return self.model.could_commit(gpus, schedulable=True) or any(
            self.model.idle(h) >= gpus for h in self.model.replica_hosts(kernel.kernel_id)
        )

    def _begin(self, kernel: _Kernel, host: HostId, at: float, reservation: str | None) -> None:
        """Run the kernel's head cell on ``host`` from ``at`` (later than now after a migration)."""
        self._waiting.pop(kernel.kernel_id, None)
        kernel.executing_on, kernel.arrival, kernel.copied = host, None, False
        cell, ideal_start = kernel.queue[0]
        gpus = kernel.session.cell_gpus(cell)
        self._delays.append(at - ideal_start)
        self._busy_gpu_s += gpus * cell.duration
        ready = min(max(cell.start, kernel.last_end), at)
        split = self._split(kernel, ready - ideal_start, ready, at)
        self._splits.append(split)
        previous_end, previous_1x = kernel.carry_1x
        behind_1x = carried_over(previous_end, previous_1x, ideal_start)
        at_1x = delay_at_1x(split, self._cfg.speedup, behind_1x)
        self._delays_1x.append(at_1x)
        kernel.carry_1x = (ideal_start + cell.duration, at_1x)
        self._user_cells.append(UserCell(kernel.user, gpus, ready, at, at + cell.duration))
        if at > self._now:
            self._at(at, _END, lambda: self._busy(gpus))
        else:
            self._busy(gpus)
        self._at(at + cell.duration, _END, lambda: self._end(kernel, host, reservation, gpus))

    def _split(self, kernel: _Kernel, queued: float, ready: float, at: float) -> DelaySplit:
        """Where the delay of the kernel's head cell, ``queued`` behind its previous cell,
        ready at ``ready`` and running from ``at``, went: its kernel's start (after its
        placement) and its GPUs' commit nbos's own overhead, the rest of ``at`` beyond
        now the migration it waits for, the rest of the wait until now for GPUs (or room
        to place its kernel) and for hosts being added."""
        placed = kernel.ready_at - self._cfg.kernel_start
        booting = max(0.0, min(self._now, kernel.ready_at) - max(ready, placed))
        commit = min(at - self._now, self._cfg.gpu_commit)
        waited, scaling = split_wait(
            self._now - ready - booting, self._scale_outs.reading() - kernel.ready_mark
        )
        return DelaySplit(
            queue=queued,
            gpus=waited,
            migration=at - self._now - commit,
            scale_out=scaling,
            overhead=booting + commit,
        )

    def _busy(self, gpus: int) -> None:
        self._gpus_busy += gpus

    def _end(self, kernel: _Kernel, host: HostId, reservation: str | None, gpus: int) -> None:
        self._gpus_busy -= gpus
        kernel.last, kernel.executing_on, kernel.last_end = host, None, self._now
        kernel.queue.popleft()
        kernel.ready_mark = self._scale_outs.reading()
        if reservation is not None:
            self._release(host, reservation, resident=True)
            self._user_gpus.remove(kernel.user, gpus)
            self._wake_cells()
        self._try_run(kernel)
        self._maybe_finish(kernel)

    def _wake_cells(self) -> None:
        """Give freed GPUs to waiting cells: longest waiting first, within-quota cells before
        borrowing ones with a fair share."""
        waiting = list(self._waiting.values())
        if self._fair is not None:
            held = self._user_gpus.view()
            fair = self._fair
            waiting.sort(key=lambda k: fair.order(self._waiter(k), held))
        for kernel in waiting:
            if not self.model.could_commit(1, schedulable=False):
                return  # every GPU of the cluster is committed
            if kernel.kernel_id in self._waiting and self._could_run(kernel):
                self._try_run(kernel)

    # --- hosts and scaling -------------------------------------------------------

    def _tick(self) -> None:
        if self._cfg.mode == "nbos":
            # The demand ratio drifts every event; placements it now admits are retried here.
            self._place_pending()
        self._drain()
        if self._cfg.precopy and self._cfg.mode == "nbos":
            self._precopy()
        self._autoscale()
        self._sample()
        if self._progress is not None:
            self._progress(self._now)
        self._at(self._now + self._cfg.tick, _TICK, self._tick)

    def _autoscale(self) -> None:
        step = self.decisions.scale(
            self.model.view(),
            self._now,
            cells_waiting=bool(self._waiting),
            kernels_waiting=bool(self._pending),
            provisioning=self._provisioning,
        )
        self._watch_ceiling(step.at_ceiling)
        decision = step.decision
        if isinstance(decision, ScaleOut):
            self.ledger.scale_outs += 1
            count = decision.count
            self._provisioning += count
            self._scale_outs.asked(count)
            self._at(self._now + self._cfg.host_startup, _HOST, lambda: self._join(count))
        elif isinstance(decision, ScaleIn):
            self.ledger.scale_ins += 1
            for h in decision.hosts:
                self.model.set_schedulable(h, False)
            self._drain()

    def _watch_ceiling(self, at_ceiling: bool) -> None:
        """Count (and warn once about) ticks where work waits and no host may be added."""
        if not at_ceiling:
            return
        self.ledger.ceiling_s += self._cfg.tick
        if not self._warned_ceiling:
            self._warned_ceiling = True
            log.warning(
                "t=%.0f: the autoscaler is at its ceiling of %d hosts while %d kernels wait "
                "(raise max_hosts to serve them sooner)",
                self._now,
                len(self.pools) + self._provisioning,
                len(self._pending) + len(self._waiting),
            )

    def _join(self, count: int) -> None:
        self._provisioning -= count
        self._scale_outs.arrived(count)
        for _ in range(count):
            self._new_host()
        self._mark_hosts()
        self._wake_cells()
        self._place_pending()

    def _new_host(self) -> None:
        host_id = HostId(f"h{self._host_serial:03d}")
        self._host_serial += 1
        self.pools[host_id] = GpuPool(
            range(self._cfg.gpus_per_host), lambda: self._now, precommit_ttl=60.0
        )
        self.model.add_host(host_id, self._cfg.gpus_per_host)

    def _drain(self) -> None:
        """Move replicas off draining hosts; remove those that hold nothing any more."""
        draining = self.model.draining()
        for host_id in draining:
            if host_id not in self._moving_off:
                self._move_next_off(host_id)
            self._remove_if_empty(host_id)
        if draining:
            self._wake_cells()  # a moved replica may find its GPUs on its new host

    def _move_next_off(self, source: HostId) -> None:
        """Start moving the next replica off the draining ``source``: as the gateway does,
        one after another, each taking ``migration_time``."""
        for kernel_id in sorted(self.model.kernels_on(source)):
            kernel = self._kernels[kernel_id]
            if kernel.executing_on == source or kernel.reservation is not None:
                continue  # a running cell (or a session's reservation) finishes first
            hosts = self.model.replica_hosts(kernel_id)
            try:
                target = self.decisions.place_one(
                    self.model.view(), kernel_id, kernel.session.gpus, hosts
                )
            except PolicyContractError:
                raise
            except PlacementError:
                log.debug("t=%.0f: cannot move %s off %s yet", self._now, kernel_id, source)
                continue
            self._moving_off[source] = MigrationPlan(kernel_id, source, target)
            done = self._now + self._cfg.migration_time
            self._at(done, _END, functools.partial(self._moved_off, source))
            return

    def _moved_off(self, source: HostId) -> None:
        """A drain move is done: the replica is on its target (unless the kernel moved it,
        or ended, meanwhile); the next one starts, and the host goes once empty."""
        plan = self._moving_off.pop(source)
        kernel = self._kernels[plan.kernel_id]
        hosts = self.model.replica_hosts(plan.kernel_id) if kernel.placed else ()
        if plan.source in hosts and plan.target not in hosts and plan.target in self.pools:
            self._move(kernel, plan.source, plan.target)
            self.ledger.drain_moves += 1
        if self.model.is_draining(source):
            self._move_next_off(source)
            self._remove_if_empty(source)
            self._wake_cells()

    def _remove_if_empty(self, host_id: HostId) -> None:
        if host_id not in self._moving_off and self.decisions.removable(self.model.host(host_id)):
            self.model.remove_host(host_id)
            del self.pools[host_id]
            self._mark_hosts()

    def _precopy(self) -> None:
        """Start copying a replica of each idle kernel whose next cell would have to migrate
        (the gateway's autoscaler does the same every period)."""
        for kernel in self._kernels.values():
            idle = kernel.executing_on is None and not kernel.queue
            if not (kernel.placed and idle and kernel.copying is None and not kernel.copied):
                continue
            hosts = self.model.replica_hosts(kernel.kernel_id)
            staying = self.decisions.off_draining(hosts, self.model.is_draining)
            plan = self.decisions.precopy(
                self.model.view(), kernel.kernel_id, staying, kernel.session.gpus
            )
            if plan is not None:
                kernel.copying, kernel.copied = plan, True
                done = self._now + self._cfg.migration_time
                self._at(done, _END, functools.partial(self._copied, kernel))

    def _copied(self, kernel: _Kernel) -> None:
        """The copy is a voter: the source's replica goes (unless the kernel moved it already,
        or ended, meanwhile)."""
        plan, kernel.copying = kernel.copying, None
        assert plan is not None
        hosts = self.model.replica_hosts(kernel.kernel_id)
        if plan.source not in hosts or plan.target in hosts or plan.target not in self.pools:
            return
        if kernel.executing_on == plan.source:
            return  # a cell runs there: the copy is dropped, the replica stays
        self._move(kernel, plan.source, plan.target)
        self.ledger.migrations += 1
        if kernel.kernel_id in self._waiting:
            self._try_run(kernel)

    def _mark_hosts(self) -> None:
        self.ledger.hosts_changed(len(self.pools), self.model.capacity)

    # --- accounting --------------------------------------------------------------

    def _commit(self, host: HostId, kernel: _Kernel, gpus: int, reservation: str) -> str:
        first: frozenset[KernelId] = frozenset()
        if self._fair is not None:
            holders = {k: self._kernels[k].user for k in self.model.kernels_on(host)}
            first = self._fair.evict_first(holders, self._user_gpus.view())
        self.pools[host].commit(reservation, kernel.kernel_id, gpus, evict_first=first)
        self.model.commit(host, gpus)
        self.ledger.gpus_committed(self.model.committed)
        return reservation

    def _release(self, host: HostId, reservation: str, *, resident: bool = False) -> None:
        self.model.release(host, len(self.pools[host].release(reservation, resident=resident)))
        self.ledger.gpus_committed(self.model.committed)

    def _move(self, kernel: _Kernel, source: HostId, target: HostId) -> None:
        self.model.move(kernel.kernel_id, source, target)
        self.pools[source].evicted(kernel.kernel_id)
        if kernel.last == source:
            kernel.last = None

    def _sample(self) -> None:
        m = self.model
        self._samples.append(
            Sample(self._now, m.committed, self._gpus_busy, m.capacity, len(self.pools))
        )

    # --- results -----------------------------------------------------------------

    def _result(self) -> SimResult:
        run = Run(
            mode=self._cfg.mode,
            policy=self.decisions.policy.name,
            interactive_within=self._cfg.interactive_within,
            seconds=self._now,
            totals=self.ledger.totals(),
            delays=self._delays,
            splits=self._splits,
            delays_1x=self._delays_1x,
            busy_gpu_s=self._busy_gpu_s,
            peak_gpus_committed=self.ledger.peak_committed,
            hosts_timeline=tuple((h.time, h.hosts) for h in self.ledger.hosts()),
            samples=tuple(self._samples),
            user_cells=self._user_cells,
            fair_share=self._fair,
        )
        return sim_result(self._trace, run)


def _refused(error: ConfigError) -> ConfigError:
    log.warning("simulator config refused: %s", error)
    return error
