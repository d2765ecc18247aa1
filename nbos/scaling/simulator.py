"""A discrete-event simulator that replays a session trace against the real scheduling code.

It runs the same objects the cluster runs: the placement policy loaded by name
through :func:`~nbos.scaling.load_policy` (so a user's policy registered by entry
point works here unchanged), :func:`~nbos.scaling.choose_executor`,
:func:`~nbos.scaling.migration.plan_migration`, the
:class:`~nbos.scaling.autoscaler.Autoscaler`, and a real
:class:`~nbos.gpu.GpuPool` per host driven by the simulated clock. Two modes:

``"nbos"``
    Each session's kernel has ``replicas_per_kernel`` replicas placed by the
    policy (subscription-ratio admission, so hosts are oversubscribed). A cell
    commits its GPUs on the host ``choose_executor`` picks, only while it runs;
    when no replica's host can, one replica migrates (taking ``migration_time``)
    or the cell waits.
``"reservation"``
    The baseline: a session commits its GPUs on one host (the policy's
    ``migration_target``: a host that can commit them now) for its whole life,
    and its cells run at once.

Both modes run the autoscaler (unless ``SimConfig.autoscaler`` is ``None``)
every ``tick`` seconds. Events at equal times run in a fixed order (ends,
hosts joining, session starts, cells, stops, ticks; then the order they were
scheduled), so a run is deterministic given the trace, the config and a
deterministic policy (seed :class:`~nbos.scaling.RandomPolicy` via
``policy_kwargs``). Metrics are described in ``docs/simulator.md``.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from nbos.core.errors import ConfigError, InsufficientGpusError, PlacementError, ScalingError
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import ClusterView, HostView, PlacementPolicy, PlacementRequest
from nbos.gpu.pool import GpuPool
from nbos.scaling.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    ScaleIn,
    ScaleOut,
    smoothed_demand_ratio,
)
from nbos.scaling.executor import Execute, Migrate, choose_executor
from nbos.scaling.migration import plan_migration
from nbos.scaling.registry import load_policy
from nbos.scaling.trace import Cell, Session, Trace, validated

log = logging.getLogger(__name__)

Mode = Literal["nbos", "reservation"]
MODES: tuple[Mode, ...] = ("nbos", "reservation")

# Order of simultaneous events: what frees GPUs first, what looks at the result last.
_END, _HOST, _START, _SUBMIT, _STOP, _TICK = range(6)


def _check_config(instance: SimConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    limits: dict[str, tuple[float, str]] = {
        "hosts": (0, "an integer >= 0"),
        "gpus_per_host": (1, "an integer >= 1"),
        "replicas_per_kernel": (1, "an integer >= 1"),
        "tick": (1e-9, "a positive number of seconds"),
        "host_startup": (0, "a number of seconds >= 0"),
        "migration_time": (0, "a number of seconds >= 0"),
        "interactive_within": (0, "a number of seconds >= 0"),
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
    host_startup: float = attrs.field(default=60.0, validator=_check_config)
    #: Seconds a replica migration delays the cell that caused it.
    migration_time: float = attrs.field(default=10.0, validator=_check_config)
    #: A cell is *interactive* if it starts within this many seconds of being ready.
    interactive_within: float = attrs.field(default=1.0, validator=_check_config)
    #: Ticks stop this long after the trace ends; work still waiting then is unserved.
    overrun_limit: float = attrs.field(default=6 * 3600.0, validator=_check_config)


@attrs.frozen
class SimResult:
    """What one run measured (see ``docs/simulator.md`` for each figure)."""

    mode: Mode
    policy: str
    sessions: int
    cells: int
    cells_unserved: int
    hours: float
    gpu_hours_reserved: float
    gpu_hours_busy: float
    gpu_hours_provisioned: float
    delay_p50: float
    delay_p95: float
    delay_p99: float
    interactive_within: float
    interactive_share: float
    migrations: int
    drain_moves: int
    scale_outs: int
    scale_ins: int
    hosts_mean: float
    hosts_max: int
    peak_gpus_committed: int
    #: ``(time, hosts)`` at start and at each change of the host count.
    hosts_timeline: tuple[tuple[float, int], ...]

    @property
    def busy_share(self) -> float:
        """Busy GPU-hours over reserved (committed) GPU-hours."""
        return _share(self.gpu_hours_busy, self.gpu_hours_reserved)

    @property
    def utilisation(self) -> float:
        """Busy GPU-hours over provisioned GPU-hours (the hosts' GPUs over time)."""
        return _share(self.gpu_hours_busy, self.gpu_hours_provisioned)


def simulate(trace: Trace, config: SimConfig | None = None) -> SimResult:
    """Replay ``trace`` on the cluster ``config`` describes.

    Raises :class:`ScalingError` for a malformed trace or one with a session
    asking for more GPUs than a host has, :class:`~nbos.core.errors.UnknownPolicyError`
    / :class:`PlacementError` for a policy that cannot be loaded, and
    :class:`ScalingError` if the policy returns an invalid placement.
    """
    config = config if config is not None else SimConfig()
    trace = validated(trace)
    too_big = [s.id for s in trace.sessions if s.gpus > config.gpus_per_host]
    if too_big:
        message = f"sessions {too_big} ask for more than the {config.gpus_per_host} GPUs of a host"
        log.warning("%s", message)
        raise ScalingError(message)
    policy = load_policy(config.policy, **config.policy_kwargs)
    return _Simulation(trace, config, policy).run()


# --- state -----------------------------------------------------------------------------


@attrs.define
class _Host:
    host_id: HostId
    pool: GpuPool
    subscribed: int = 0
    replicas: set[KernelId] = attrs.field(factory=set)
    schedulable: bool = True


@attrs.define
class _Kernel:
    session: Session
    kernel_id: KernelId
    hosts: list[HostId] = attrs.field(factory=list)
    last: HostId | None = None
    #: Submitted cells not finished, each with when it would start on an unlimited cluster.
    queue: deque[tuple[Cell, float]] = attrs.field(factory=deque)
    #: When the last submitted cell would end on an unlimited cluster.
    ideal_end: float = 0.0
    executing_on: HostId | None = None
    stop_requested: bool = False
    finished: bool = False
    #: The lifetime reservation in reservation mode.
    reservation: str | None = None
    reservations: int = 0

    @property
    def placed(self) -> bool:
        return bool(self.hosts)

    def next_reservation(self) -> str:
        self.reservations += 1
        return f"{self.kernel_id}#{self.reservations}"


@attrs.define
class _Counters:
    migrations: int = 0
    drain_moves: int = 0
    scale_outs: int = 0
    scale_ins: int = 0
    peak_committed: int = 0
    busy_gpu_seconds: float = 0.0
    committed_gpu_seconds: float = 0.0
    provisioned_gpu_seconds: float = 0.0
    host_seconds: float = 0.0
    delays: list[float] = attrs.field(factory=list)


class _Simulation:
    def __init__(self, trace: Trace, config: SimConfig, policy: PlacementPolicy) -> None:
        self._trace = trace
        self._cfg = config
        self._policy = policy
        self._autoscaler = Autoscaler(config.autoscaler) if config.autoscaler else None
        self._now = 0.0
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = 0
        self._hosts: dict[HostId, _Host] = {}
        self._host_serial = 0
        self._kernels: dict[KernelId, _Kernel] = {}
        self._pending: dict[KernelId, _Kernel] = {}  # not placed yet, FIFO
        self._waiting: dict[KernelId, _Kernel] = {}  # head cell waits for GPUs, FIFO
        self._unfinished = len(trace.sessions)
        self._provisioning = 0
        self._committed = 0
        self._ratio = 1.0
        self._n = _Counters()
        self._timeline: list[tuple[float, int]] = []
        for _ in range(config.hosts):
            self._new_host()
        self._timeline.append((0.0, len(self._hosts)))

    # --- the loop ------------------------------------------------------------------

    def run(self) -> SimResult:
        for s in self._trace.sessions:
            self._schedule_session(s)
        self._at(0.0, _TICK, self._tick)
        while self._events:
            when, order, _, action = heapq.heappop(self._events)
            if order == _TICK and not self._unfinished:
                continue  # the run ends with its last session, not a tick later
            self._advance(when)
            action()
            self._update_ratio()
        return self._result()

    def _at(self, when: float, order: int, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, order, self._seq, action))

    def _advance(self, when: float) -> None:
        dt = when - self._now
        if dt > 0:
            self._n.host_seconds += len(self._hosts) * dt
            self._n.provisioned_gpu_seconds += (
                sum(h.pool.counts().total for h in self._hosts.values()) * dt
            )
            self._n.committed_gpu_seconds += self._committed * dt
            self._now = when

    def _schedule_session(self, s: Session) -> None:
        kernel = _Kernel(s, KernelId(s.id))
        self._kernels[kernel.kernel_id] = kernel
        self._at(s.start, _START, lambda: self._start(kernel))
        for cell in s.cells:
            self._at(cell.start, _SUBMIT, functools.partial(self._submit, kernel, cell))
        self._at(s.stop, _STOP, lambda: self._stop(kernel))

    # --- sessions ------------------------------------------------------------------

    def _start(self, kernel: _Kernel) -> None:
        self._pending[kernel.kernel_id] = kernel
        self._place_pending()

    def _place_pending(self) -> None:
        for kernel in list(self._pending.values()):
            # A nested call (a kernel finishing frees room) may have placed it already.
            if kernel.kernel_id in self._pending and self._place(kernel):
                del self._pending[kernel.kernel_id]
                self._try_run(kernel)
                self._maybe_finish(kernel)

    def _place(self, kernel: _Kernel) -> bool:
        gpus = kernel.session.gpus
        if self._cfg.mode == "reservation":
            request = PlacementRequest(kernel.kernel_id, gpus, 1)
            target = self._policy.migration_target(request, self._view())
            if target is None:
                return False
            self._check_hosts(kernel, [target], 1)
            kernel.reservation = kernel.next_reservation()
            self._commit(target, kernel, gpus, kernel.reservation)
            self._subscribe(kernel, target)
            return True
        request = PlacementRequest(kernel.kernel_id, gpus, self._cfg.replicas_per_kernel)
        try:
            hosts = list(self._policy.place(request, self._view()))
        except PlacementError as exc:
            log.debug("t=%.0f: %s", self._now, exc)
            return False
        self._check_hosts(kernel, hosts, self._cfg.replicas_per_kernel)
        for h in hosts:
            self._subscribe(kernel, h)
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
        if kernel.kernel_id in self._pending:
            del self._pending[kernel.kernel_id]
        for h in list(kernel.hosts):
            host = self._hosts[h]
            if kernel.reservation is not None:
                self._release(h, kernel.reservation)
            host.pool.release_kernel(kernel.kernel_id)
            self._unsubscribe(kernel, h)
        self._unfinished -= 1
        self._retry()

    # --- cells ---------------------------------------------------------------------

    def _submit(self, kernel: _Kernel, cell: Cell) -> None:
        # Cells of one kernel run one after another, so on an unlimited cluster a cell
        # starts when it is submitted or when the previous one ends, whichever is later.
        ideal_start = max(self._now, kernel.ideal_end)
        kernel.ideal_end = ideal_start + cell.duration
        kernel.queue.append((cell, ideal_start))
        self._try_run(kernel)

    def _try_run(self, kernel: _Kernel) -> bool:
        """Start the kernel's next cell if it can start now; True if it did."""
        if not kernel.placed or kernel.executing_on is not None or not kernel.queue:
            return False
        gpus = kernel.session.cell_gpus(kernel.queue[0][0])
        if self._cfg.mode == "reservation":
            self._begin(kernel, kernel.hosts[0], self._now, None)
            return True
        view = self._view()
        try:
            choice = choose_executor(kernel.last, kernel.hosts, view, gpus)
        except InsufficientGpusError:
            choice = None  # only while no host is up; hosts are all large enough
        if isinstance(choice, Execute):
            reservation = self._commit(choice.host, kernel, gpus, kernel.next_reservation())
            self._begin(kernel, choice.host, self._now, reservation)
            return True
        if isinstance(choice, Migrate):
            request = PlacementRequest(kernel.kernel_id, gpus, self._cfg.replicas_per_kernel)
            plan = plan_migration(kernel.hosts, request, view, self._policy)
            if plan is not None:
                self._move(kernel, plan.source, plan.target)
                self._n.migrations += 1
                reservation = self._commit(plan.target, kernel, gpus, kernel.next_reservation())
                ready = self._now + self._cfg.migration_time
                self._begin(kernel, plan.target, ready, reservation)
                return True
        self._waiting.setdefault(kernel.kernel_id, kernel)
        return False

    def _begin(self, kernel: _Kernel, host: HostId, at: float, reservation: str | None) -> None:
        """Run the kernel's head cell on ``host`` from ``at`` (later than now after a migration)."""
        self._waiting.pop(kernel.kernel_id, None)
        kernel.executing_on = host
        cell, ideal_start = kernel.queue[0]
        self._n.delays.append(at - ideal_start)
        self._n.busy_gpu_seconds += kernel.session.cell_gpus(cell) * cell.duration
        self._at(at + cell.duration, _END, lambda: self._end(kernel, host, reservation))

    def _end(self, kernel: _Kernel, host: HostId, reservation: str | None) -> None:
        if reservation is not None:
            self._release(host, reservation, resident=True)
        kernel.last, kernel.executing_on = host, None
        kernel.queue.popleft()
        self._retry()
        self._try_run(kernel)
        self._maybe_finish(kernel)

    def _retry(self) -> None:
        """Give freed capacity to waiting cells (longest waiting first), then pending kernels."""
        for kernel in list(self._waiting.values()):
            self._try_run(kernel)
        self._place_pending()

    # --- hosts and scaling -------------------------------------------------------

    def _tick(self) -> None:
        self._place_pending()
        self._drain()
        if self._autoscaler is not None:
            self._autoscale(self._autoscaler)
        if self._unfinished and self._now <= self._trace.end + self._cfg.overrun_limit:
            self._at(self._now + self._cfg.tick, _TICK, self._tick)

    def _autoscale(self, autoscaler: Autoscaler) -> None:
        failed = bool(self._pending or self._waiting)
        decision = autoscaler.decide(self._view(), self._now, failed, self._provisioning)
        if isinstance(decision, ScaleOut):
            self._n.scale_outs += 1
            count = decision.count
            self._provisioning += count
            self._at(self._now + self._cfg.host_startup, _HOST, lambda: self._join(count))
        elif isinstance(decision, ScaleIn):
            self._n.scale_ins += 1
            for h in decision.hosts:
                self._hosts[h].schedulable = False
            self._drain()

    def _join(self, count: int) -> None:
        self._provisioning -= count
        for _ in range(count):
            self._new_host()
        self._mark_hosts()
        self._retry()

    def _new_host(self) -> None:
        host_id = HostId(f"h{self._host_serial:03d}")
        self._host_serial += 1
        pool = GpuPool(range(self._cfg.gpus_per_host), lambda: self._now, precommit_ttl=60.0)
        self._hosts[host_id] = _Host(host_id, pool)

    def _drain(self) -> None:
        """Move replicas off draining hosts; remove those left empty and idle."""
        draining = [h for h in self._hosts.values() if not h.schedulable]
        for host in draining:
            for kernel_id in sorted(host.replicas):
                self._evacuate(self._kernels[kernel_id], host.host_id)
            if not host.replicas and host.pool.counts().idle == host.pool.counts().total:
                del self._hosts[host.host_id]
                self._mark_hosts()
        if draining:
            self._retry()

    def _evacuate(self, kernel: _Kernel, source: HostId) -> None:
        if kernel.executing_on == source:
            return  # a running cell finishes first
        request = PlacementRequest(
            kernel.kernel_id, kernel.session.gpus, 1, frozenset(kernel.hosts)
        )
        try:
            chosen = list(self._policy.place(request, self._view()))
        except PlacementError:
            log.debug("t=%.0f: cannot move %s off %s yet", self._now, kernel.kernel_id, source)
            return
        self._check_hosts(kernel, chosen, 1, request.exclude)
        self._move(kernel, source, chosen[0])
        self._n.drain_moves += 1

    def _mark_hosts(self) -> None:
        self._timeline.append((self._now, len(self._hosts)))

    # --- accounting --------------------------------------------------------------

    def _commit(self, host: HostId, kernel: _Kernel, gpus: int, reservation: str) -> str:
        self._hosts[host].pool.commit(reservation, kernel.kernel_id, gpus)
        self._committed += gpus
        self._n.peak_committed = max(self._n.peak_committed, self._committed)
        return reservation

    def _release(self, host: HostId, reservation: str, *, resident: bool = False) -> None:
        self._committed -= len(self._hosts[host].pool.release(reservation, resident=resident))

    def _subscribe(self, kernel: _Kernel, host_id: HostId) -> None:
        host = self._hosts[host_id]
        host.subscribed += kernel.session.gpus
        host.replicas.add(kernel.kernel_id)
        kernel.hosts.append(host_id)

    def _unsubscribe(self, kernel: _Kernel, host_id: HostId) -> None:
        host = self._hosts[host_id]
        host.subscribed -= kernel.session.gpus
        host.replicas.discard(kernel.kernel_id)
        kernel.hosts.remove(host_id)

    def _move(self, kernel: _Kernel, source: HostId, target: HostId) -> None:
        index = kernel.hosts.index(source)
        self._unsubscribe(kernel, source)
        self._hosts[source].pool.evicted(kernel.kernel_id)
        self._subscribe(kernel, target)
        # Keep the replica order: choose_executor breaks ties by it.
        kernel.hosts.insert(index, kernel.hosts.pop())
        if kernel.last == source:
            kernel.last = None

    def _update_ratio(self) -> None:
        if self._cfg.mode != "nbos":
            return
        demand = sum(k.session.gpus for k in self._kernels.values() if k.placed)
        self._ratio = smoothed_demand_ratio(self._ratio, demand, self._committed)

    def _view(self) -> ClusterView:
        hosts = []
        for h in self._hosts.values():
            counts = h.pool.counts()
            busy = counts.total - counts.idle
            hosts.append(
                HostView(
                    h.host_id, counts.total, busy, h.subscribed, len(h.replicas), h.schedulable
                )
            )
        return ClusterView(hosts, self._cfg.replicas_per_kernel, self._ratio)

    def _check_hosts(
        self,
        kernel: _Kernel,
        chosen: Sequence[HostId],
        count: int,
        exclude: frozenset[HostId] = frozenset(),
    ) -> None:
        valid = (
            len(chosen) == count
            and len(set(chosen)) == count
            and all(h in self._hosts and self._hosts[h].schedulable for h in chosen)
            and not exclude & set(chosen)
        )
        if not valid:
            message = (
                f"policy {self._policy.name!r} placed kernel {kernel.kernel_id} on "
                f"{list(chosen)}: needs {count} distinct schedulable hosts "
                f"outside {sorted(exclude)}"
            )
            log.warning("%s", message)
            raise ScalingError(message)

    # --- results -----------------------------------------------------------------

    def _result(self) -> SimResult:
        n, end = self._n, self._now
        delays = sorted(n.delays)
        served = len(delays)
        total_cells = sum(len(s.cells) for s in self._trace.sessions)
        fast = sum(1 for d in delays if d <= self._cfg.interactive_within)
        return SimResult(
            mode=self._cfg.mode,
            policy=self._policy.name,
            sessions=len(self._trace.sessions),
            cells=total_cells,
            cells_unserved=total_cells - served,
            hours=end / 3600,
            gpu_hours_reserved=n.committed_gpu_seconds / 3600,
            gpu_hours_busy=n.busy_gpu_seconds / 3600,
            gpu_hours_provisioned=n.provisioned_gpu_seconds / 3600,
            delay_p50=_percentile(delays, 0.50),
            delay_p95=_percentile(delays, 0.95),
            delay_p99=_percentile(delays, 0.99),
            interactive_within=self._cfg.interactive_within,
            interactive_share=_share(fast, total_cells),
            migrations=n.migrations,
            drain_moves=n.drain_moves,
            scale_outs=n.scale_outs,
            scale_ins=n.scale_ins,
            hosts_mean=n.host_seconds / end if end > 0 else float(len(self._hosts)),
            hosts_max=max(count for _, count in self._timeline),
            peak_gpus_committed=n.peak_committed,
            hosts_timeline=tuple(self._timeline),
        )


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; 0 for no values."""
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _refused(error: ConfigError) -> ConfigError:
    log.warning("simulator config refused: %s", error)
    return error


# --- reporting -------------------------------------------------------------------------

_ROWS: tuple[tuple[str, Callable[[SimResult], str]], ...] = (
    ("policy", lambda r: r.policy),
    ("sessions / cells", lambda r: f"{r.sessions} / {r.cells}"),
    ("cells never run", lambda r: f"{r.cells_unserved}"),
    ("simulated hours", lambda r: f"{r.hours:.1f}"),
    ("GPU-hours reserved", lambda r: f"{r.gpu_hours_reserved:,.0f}"),
    ("GPU-hours busy", lambda r: f"{r.gpu_hours_busy:,.0f}"),
    ("GPU-hours provisioned", lambda r: f"{r.gpu_hours_provisioned:,.0f}"),
    ("busy / reserved", lambda r: f"{r.busy_share:.1%}"),
    ("utilisation (busy / provisioned)", lambda r: f"{r.utilisation:.1%}"),
    (
        "cell delay p50 / p95 / p99 (s)",
        lambda r: f"{r.delay_p50:.1f} / {r.delay_p95:.1f} / {r.delay_p99:.1f}",
    ),
    (
        "interactive (start within)",
        lambda r: f"{r.interactive_share:.1%} ({r.interactive_within:g} s)",
    ),
    ("migrations / drain moves", lambda r: f"{r.migrations} / {r.drain_moves}"),
    ("scale-outs / scale-ins", lambda r: f"{r.scale_outs} / {r.scale_ins}"),
    ("hosts mean / max", lambda r: f"{r.hosts_mean:.1f} / {r.hosts_max}"),
    ("peak GPUs committed", lambda r: f"{r.peak_gpus_committed}"),
)


def metrics_table(results: Sequence[SimResult]) -> str:
    """The results side by side, one column per run, as plain text."""
    header = ("metric", *(r.mode for r in results))
    rows = [header, *((label, *(fmt(r) for r in results)) for label, fmt in _ROWS)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
