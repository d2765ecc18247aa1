"""Pictures of simulation results: GPUs and hosts over time per mode, the cell delay CDF, and
each user's GPU-hours against their fair share and p99 wait.

Needs matplotlib (the ``plot`` extra: ``pip install 'nbos[plot]'``); without it
:func:`plot_results` raises :class:`~nbos.core.errors.ConfigError`. The figure is
drawn off-screen (the Agg backend) and written to a file whose suffix names the
format (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nbos.core.errors import ConfigError
from nbos.scaling.fairness import UserFigures
from nbos.scaling.results import SimResult

log = logging.getLogger(__name__)


def plot_results(results: Sequence[SimResult], path: str | Path) -> Path:
    """Draw ``results`` (one column per mode) into ``path`` and return it.

    Row 1: GPUs provisioned, committed and busy over time; row 2: hosts over
    time; row 3: the CDF of cell delays of every mode; row 4: each user's GPU-hours
    used over their fair share, with Jain's index; row 5: each user's p99 wait. Raises
    :class:`ConfigError` without matplotlib or for an empty ``results``.
    """
    if not results:
        raise _refused(ConfigError("results", [], "at least one simulation result"))
    plt = _pyplot()
    path = Path(path)
    scale, unit = _time_unit(max(r.hours for r in results))
    fig = plt.figure(figsize=(6 * len(results), 16), layout="constrained")
    grid = fig.add_gridspec(5, len(results))
    gpu_axes = [fig.add_subplot(grid[0, i]) for i in range(len(results))]
    host_axes = [fig.add_subplot(grid[1, i], sharex=gpu_axes[i]) for i in range(len(results))]
    gpus_top = max((s.gpus_provisioned for r in results for s in r.samples), default=1)
    hosts_top = max(r.hosts_max for r in results)
    for i, result in enumerate(results):
        _gpus(gpu_axes[i], result, scale, unit)
        _hosts(host_axes[i], result, scale, unit)
        # The same scale in every column, so modes compare at a glance.
        gpu_axes[i].set_ylim(0, gpus_top * 1.05 + 1)
        host_axes[i].set_ylim(0, hosts_top * 1.05 + 1)
    _delays(fig.add_subplot(grid[2, :]), results)
    _user_shares(fig.add_subplot(grid[3, :]), results)
    _user_waits(fig.add_subplot(grid[4, :]), results)
    fig.suptitle(f"nbos simulate: policy {results[0].policy}, {results[0].sessions} sessions")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return path


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise _refused(
            ConfigError("--plot", str(exc), "matplotlib installed (pip install 'nbos[plot]')")
        ) from exc
    return plt


def _time_unit(hours: float) -> tuple[float, str]:
    """Seconds per plotted unit: days for runs longer than three days, else hours."""
    return (86400.0, "days") if hours > 72 else (3600.0, "hours")


def _gpus(ax: Any, result: SimResult, scale: float, unit: str) -> None:
    times = [s.time / scale for s in result.samples]
    ax.step(
        times,
        [s.gpus_provisioned for s in result.samples],
        where="post",
        label="provisioned",
        color="#555555",
        linewidth=1.0,
    )
    # Committed as an area under the busy line: in nbos mode the two nearly coincide.
    ax.fill_between(
        times,
        [s.gpus_committed for s in result.samples],
        step="post",
        label="committed",
        color="#9ecae1",
        linewidth=0,
    )
    ax.step(times, [s.gpus_busy for s in result.samples], where="post",
            label="busy", color="#d95f02", linewidth=0.6)  # fmt: skip
    ax.set_title(
        f"{result.mode}: GPUs (reserved {result.gpu_hours_reserved:,.0f} GPU-h, "
        f"busy {result.busy_share:.0%} of it)"
    )
    ax.set_xlabel(f"simulated time ({unit})")
    ax.set_ylabel("GPUs")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)


def _hosts(ax: Any, result: SimResult, scale: float, unit: str) -> None:
    times = [t / scale for t, _ in result.hosts_timeline] + [result.hours * 3600 / scale]
    counts = [n for _, n in result.hosts_timeline]
    counts.append(counts[-1])
    ax.step(times, counts, where="post", color="#d62728", linewidth=1.0)
    ceiling = f"; {result.hours_at_ceiling:.0f} h at ceiling" if result.hours_at_ceiling else ""
    ax.set_title(f"{result.mode}: hosts (mean {result.hosts_mean:.1f}, max {result.hosts_max}"
                 f"{ceiling})")  # fmt: skip
    ax.set_xlabel(f"simulated time ({unit})")
    ax.set_ylabel("hosts")
    ax.grid(alpha=0.3)


def _delays(ax: Any, results: Sequence[SimResult]) -> None:
    for result in results:
        delays = result.delays
        if not delays:
            continue
        # Steps at each delay; the share of the trace's cells, so never-run ones keep it below 1.
        shares = [(i + 1) / result.cells for i in range(len(delays))]
        ax.step(delays, shares, where="post", label=f"{result.mode} ({result.cells_unserved} "
                "never run)")  # fmt: skip
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_title("cell delay CDF (start - start on an unlimited cluster)")
    ax.set_xlabel("delay (s, linear below 1 s, log above)")
    ax.set_ylabel("share of cells")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, which="both")


def _user_bars(
    ax: Any,
    results: Sequence[SimResult],
    value: Callable[[UserFigures], float],
    label: Callable[[SimResult], str],
) -> None:
    """Grouped bars: one group per user (of every result), one bar per result."""
    users = sorted({u.user for r in results for u in r.users})
    width = 0.8 / len(results)
    for i, result in enumerate(results):
        mine = {u.user: value(u) for u in result.users}
        xs = [x + (i - (len(results) - 1) / 2) * width for x in range(len(users))]
        ax.bar(xs, [mine.get(u, 0.0) for u in users], width, label=label(result))
    ax.set_xticks(range(len(users)), [u or "(none)" for u in users], rotation=60, fontsize="small")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3, axis="y")


def _user_shares(ax: Any, results: Sequence[SimResult]) -> None:
    _user_bars(
        ax,
        results,
        lambda u: u.gpu_hours / u.fair_gpu_hours if u.fair_gpu_hours else 0.0,
        lambda r: f"{r.mode} (Jain's index {r.jain_index:.2f})",
    )
    ax.axhline(1.0, color="#555555", linewidth=0.8, linestyle="--")
    ax.set_title("each user's GPU-hours over their fair share (1: exactly their share)")
    ax.set_ylabel("used / fair share")


def _user_waits(ax: Any, results: Sequence[SimResult]) -> None:
    _user_bars(ax, results, lambda u: u.wait_p99, lambda r: r.mode)
    ax.set_title("each user's p99 wait for GPUs (from ready to started)")
    ax.set_ylabel("seconds")


def _refused(error: ConfigError) -> ConfigError:
    log.warning("cannot plot: %s", error)
    return error
