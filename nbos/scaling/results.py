"""The figures of one run and the table of several: what ``nbos simulate`` and ``nbos replay``
both print.

A run, simulated or replayed on a live cluster, is measured as a :class:`Run` (its
:class:`~nbos.scaling.ledger.Ledger`'s totals, its cells' delays and work, in trace
seconds); :func:`sim_result` sums it up as a :class:`SimResult` the same way for both,
and :func:`metrics_table` prints results side by side. ``docs/simulator.md`` describes
each figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import msgspec

from nbos.scaling.delays import DelaySplit
from nbos.scaling.fair_share import FairShare
from nbos.scaling.fairness import UserCell, UserFigures, jain_index, percentile, user_figures
from nbos.scaling.ledger import Totals
from nbos.scaling.trace import Trace


class Sample(NamedTuple):
    """The cluster at one moment: GPUs committed, running cells, of the hosts, and hosts."""

    time: float
    gpus_committed: int
    gpus_busy: int
    gpus_provisioned: int
    hosts: int


@attrs.frozen
class SimResult:
    """What one run measured (see ``docs/simulator.md`` for each figure)."""

    #: The simulator's mode, or ``"replay"`` for a live cluster's (``nbos replay``).
    mode: str
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
    #: Hours at the autoscaler's host ceiling while work waited (ticks counted).
    hours_at_ceiling: float
    #: ``(time, hosts)`` at start and at each change of the host count.
    hosts_timeline: tuple[tuple[float, int], ...]
    #: The cluster over time, for plots.
    samples: tuple[Sample, ...] = ()
    #: Every started cell's delay (seconds), sorted.
    delays: tuple[float, ...] = ()
    #: Each user's GPU-hours, fair share and p99 wait, by user name.
    users: tuple[UserFigures, ...] = ()
    #: Jain's fairness index of the users' GPU-hours over their fair shares (1: in proportion).
    jain_index: float = 1.0
    #: A replay's trace seconds per real second (``None``: simulated, no real time).
    speedup: float | None = None
    #: A replay's own overhead per started cell, real seconds, sorted: from the cell's due
    #: time to its GPU request reaching the scheduler (the part of its delay that is not
    #: a wait for GPUs: kernel start, client, front, the executor's claim).
    overheads: tuple[float, ...] = ()
    #: Where the started cells' delays went, summed (trace seconds; :mod:`nbos.scaling.delays`).
    delay_split: DelaySplit = attrs.field(factory=DelaySplit)
    #: The share of cells that a user at 1x would have seen start within
    #: ``interactive_within`` (:attr:`Run.delays_1x`): of a replay, and of the simulation
    #: beside it (``SimConfig.speedup``), counted by the same rule.
    interactive_share_1x: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The figures as plain values (no samples, delays or overheads), with the two
        shares and, for a replay, the percentiles in real seconds."""
        fields = attrs.fields(SimResult)
        data = attrs.asdict(
            self, filter=attrs.filters.exclude(fields.samples, fields.delays, fields.overheads)
        )
        data["hosts_timeline"] = [list(point) for point in self.hosts_timeline]
        data["delay_split"] = msgspec.structs.asdict(self.delay_split)
        data["busy_share"] = self.busy_share
        data["utilisation"] = self.utilisation
        if self.speedup is not None:
            data["delay_real_s"] = self.real_delays()
            data["overhead_real_s"] = _percentiles(self.overheads)
        return data

    def real_delays(self) -> tuple[float, float, float]:
        """The delay percentiles p50, p95, p99 in real seconds (a replay's only)."""
        k = self.speedup or 1.0
        return (self.delay_p50 / k, self.delay_p95 / k, self.delay_p99 / k)

    @property
    def busy_share(self) -> float:
        """Busy GPU-hours over reserved (committed) GPU-hours."""
        return _share(self.gpu_hours_busy, self.gpu_hours_reserved)

    @property
    def utilisation(self) -> float:
        """Busy GPU-hours over provisioned GPU-hours (the hosts' GPUs over time)."""
        return _share(self.gpu_hours_busy, self.gpu_hours_provisioned)


@attrs.frozen
class Run:
    """What one run of a trace measured, all times in trace seconds."""

    mode: str
    policy: str
    interactive_within: float
    #: From the trace's start to the run's end.
    seconds: float
    #: The cluster's ledger over the run.
    totals: Totals
    #: Every started cell's delay.
    delays: Sequence[float]
    #: GPUs times duration of every started cell: the trace's work.
    busy_gpu_s: float
    peak_gpus_committed: int
    hosts_timeline: tuple[tuple[float, int], ...]
    samples: tuple[Sample, ...]
    #: Every started cell by user, for the users' figures.
    user_cells: Sequence[UserCell] = ()
    #: The quotas the run kept to (``None``: none), for the users' fair shares.
    fair_share: FairShare | None = None
    #: A replay's speed-up, and its own overhead per started cell in real seconds
    #: (:attr:`SimResult.overheads`).
    speedup: float | None = None
    overheads: Sequence[float] = ()
    #: Every started cell's delay by cause (:class:`DelaySplit`), as ``delays``.
    splits: Sequence[DelaySplit] = ()
    #: Every started cell's delay as a user would feel it at 1x
    #: (:func:`~nbos.scaling.delays.delay_at_1x`): the waits other cells caused in trace
    #: seconds, nbos's own time in real seconds.
    delays_1x: Sequence[float] = ()


def sim_result(trace: Trace, run: Run) -> SimResult:
    """``run``'s figures for the table, its cells counted against ``trace``'s."""
    users = user_figures(trace, run.user_cells, run.fair_share)
    delays = sorted(run.delays)
    cells = sum(len(s.cells) for s in trace.sessions)
    fast = sum(1 for d in delays if d <= run.interactive_within)
    totals = run.totals
    hosts_now = run.hosts_timeline[-1][1] if run.hosts_timeline else 0
    return SimResult(
        mode=run.mode,
        policy=run.policy,
        sessions=len(trace.sessions),
        cells=cells,
        cells_unserved=cells - len(delays),
        hours=run.seconds / 3600,
        gpu_hours_reserved=totals.committed_gpu_s / 3600,
        gpu_hours_busy=run.busy_gpu_s / 3600,
        gpu_hours_provisioned=totals.provisioned_gpu_s / 3600,
        delay_p50=percentile(delays, 0.50),
        delay_p95=percentile(delays, 0.95),
        delay_p99=percentile(delays, 0.99),
        interactive_within=run.interactive_within,
        interactive_share=_share(fast, cells),
        migrations=totals.migrations,
        drain_moves=totals.drain_moves,
        scale_outs=totals.scale_outs,
        scale_ins=totals.scale_ins,
        hosts_mean=totals.host_s / run.seconds if run.seconds > 0 else float(hosts_now),
        hosts_max=max((count for _, count in run.hosts_timeline), default=0),
        peak_gpus_committed=run.peak_gpus_committed,
        hours_at_ceiling=totals.ceiling_s / 3600,
        hosts_timeline=run.hosts_timeline,
        samples=run.samples,
        delays=tuple(delays),
        users=users,
        jain_index=jain_index([u.gpu_hours / u.fair_gpu_hours for u in users if u.fair_gpu_hours]),
        speedup=run.speedup,
        overheads=tuple(sorted(run.overheads)),
        delay_split=sum(run.splits, DelaySplit()),
        interactive_share_1x=_share(
            sum(1 for d in run.delays_1x if d <= run.interactive_within), cells
        ),
    )


def _per_cell(r: SimResult) -> str:
    """The delay split as seconds per started cell, cause by cause."""
    started = len(r.delays)
    return " / ".join(f"{v / started if started else 0.0:.1f}" for v in r.delay_split.values())


def _percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return (percentile(ordered, 0.50), percentile(ordered, 0.95), percentile(ordered, 0.99))


def _three(values: tuple[float, float, float] | None) -> str:
    return "-" if values is None else " / ".join(f"{v:.1f}" for v in values)


def _share(part: float, whole: float) -> float:
    """``part / whole``, and 0 of nothing."""
    return part / whole if whole > 0 else 0.0


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
        "cell delay p50 / p95 / p99 (real s)",
        lambda r: _three(r.real_delays() if r.speedup is not None else None),
    ),
    (
        "replay overhead p50 / p95 / p99 (real s)",
        lambda r: _three(_percentiles(r.overheads) if r.speedup is not None else None),
    ),
    (
        "interactive (start within)",
        lambda r: f"{r.interactive_share:.1%} ({r.interactive_within:g} s)",
    ),
    (
        "interactive at 1x (start within)",
        lambda r: f"{r.interactive_share_1x:.1%} ({r.interactive_within:g} s)",
    ),
    ("delay by cause (s per cell): queue/GPUs/migr./scale-out/own", _per_cell),
    ("migrations / drain moves", lambda r: f"{r.migrations} / {r.drain_moves}"),
    ("scale-outs / scale-ins", lambda r: f"{r.scale_outs} / {r.scale_ins}"),
    ("hosts mean / max", lambda r: f"{r.hosts_mean:.1f} / {r.hosts_max}"),
    ("peak GPUs committed", lambda r: f"{r.peak_gpus_committed}"),
    ("hours at host ceiling, work waiting", lambda r: f"{r.hours_at_ceiling:.1f}"),
    ("users / Jain's fairness index", lambda r: f"{len(r.users)} / {r.jain_index:.3f}"),
)


def metrics_table(results: Sequence[SimResult]) -> str:
    """The results side by side, one column per run, as plain text."""
    header = ("metric", *(r.mode for r in results))
    replayed = any(r.speedup is not None for r in results)
    rows = [
        (label, fmt)
        for label, fmt in _ROWS
        if replayed or ("real s" not in label and "at 1x" not in label)
    ]
    return _columns([header, *((label, *(fmt(r) for r in results)) for label, fmt in rows)])


def users_table(result: SimResult) -> str:
    """One row per user of ``result``: quota, cells, GPU-hours used and fair, p99 wait."""
    header = ("user", "quota", "cells", "GPU-h", "fair GPU-h", "used / fair", "wait p99 (s)")
    rows = [header] + [
        (
            u.user or "(none)",
            "-" if u.quota is None else str(u.quota),
            str(u.cells),
            f"{u.gpu_hours:,.2f}",
            f"{u.fair_gpu_hours:,.2f}",
            f"{_share(u.gpu_hours, u.fair_gpu_hours):.0%}" if u.fair_gpu_hours else "-",
            f"{u.wait_p99:.1f}",
        )
        for u in result.users
    ]
    title = f"{result.mode}: per user (Jain's fairness index {result.jain_index:.3f})"
    return f"{title}\n{_columns(rows)}"


def _columns(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` as plain text columns: the first left-aligned, the others right-aligned, a
    rule under the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
