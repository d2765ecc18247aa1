"""``nbos chaos``: break a replicated kernel on purpose, check it keeps its promises."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import anyio

from nbos.chaos import (
    ChaosReport,
    FaultReport,
    Nemesis,
    Observer,
    PlannedFault,
    Strike,
    check_supported,
    known_nemeses,
    run_chaos,
)
from nbos.cli._progress import progress_bar
from nbos.cluster import LocalCluster
from nbos.core.config import Settings

if TYPE_CHECKING:
    from tqdm import tqdm


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``chaos`` subcommand; its handler is set as ``func``."""
    names = [n.name for n in known_nemeses()]
    p = subparsers.add_parser(
        "chaos",
        help="inject faults into a replicated kernel and check exactly-once and consistency",
        description=(
            "Start a kernel on the embedded local cluster, run a checked workload on it "
            "while a seeded schedule of faults (kill -9, SIGSTOP/SIGCONT, two kills at "
            "once) strikes, and print one line per fault. Exits 1 if any check failed. "
            "See docs/chaos.md."
        ),
    )
    p.add_argument(
        "--duration", type=float, default=60.0, help="seconds after which no fault starts (60)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="schedule seed (0); a seed replays the same faults"
    )
    p.add_argument("--hosts", type=int, help="virtual hosts (default: config, 3)")
    p.add_argument(
        "--nemesis",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"a fault to inject, repeatable (default: all the cluster can run): "
        f"{', '.join(names)}",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chaos session ``args`` describe; 0 if no check failed."""
    settings = Settings.load(args.config)
    by_name = {n.name: n for n in known_nemeses()}
    nemeses = [by_name[name] for name in args.nemesis] if args.nemesis else None
    if nemeses is not None:
        check_supported(nemeses)  # before a cluster starts for nothing
    hosts = args.hosts or settings.cluster.hosts
    report = anyio.run(_chaos, hosts, settings, args.duration, args.seed, nemeses)
    print(report.table())
    return 0 if report.ok else 1


async def _chaos(
    hosts: int, settings: Settings, duration: float, seed: int, nemeses: Sequence[Nemesis] | None
) -> ChaosReport:
    async with LocalCluster(hosts=hosts, settings=settings) as cluster:
        kernel = await cluster.start_kernel()
        placed = ", ".join(f"replica {r.node} on {r.host}" for r in kernel.replicas)
        print(f"kernel {kernel.kernel_id}: {placed}; seed {seed}", file=sys.stderr)
        with _progress(duration) as observer:
            return await run_chaos(
                kernel, seed=seed, duration_s=duration, nemeses=nemeses, observer=observer
            )


@contextlib.contextmanager
def _progress(duration: float) -> Iterator[Observer]:
    """Progress on stderr (the table goes to stdout): a bar over the run on a terminal,
    else one line per fault event."""
    with progress_bar(duration, "starting", "s") as bar:
        yield _Lines() if bar is None else _Bar(bar)


class _Lines:
    """Progress as one line per fault event on stderr."""

    def fault_started(self, fault: PlannedFault, strike: Strike) -> None:
        print(f"fault {fault.number}: {fault.nemesis} {strike.target}", file=sys.stderr)

    def fault_done(self, report: FaultReport) -> None:
        print(f"fault {report.number}: {_outcome(report)}", file=sys.stderr)


class _Bar:
    """Progress as a bar over the run's duration, naming the fault in force."""

    def __init__(self, bar: tqdm[None]) -> None:
        self._bar = bar
        self._begun = time.monotonic()

    def fault_started(self, fault: PlannedFault, strike: Strike) -> None:
        self._update(f"fault {fault.number}: {fault.nemesis} {strike.target}")

    def fault_done(self, report: FaultReport) -> None:
        self._bar.write(
            f"fault {report.number}: {report.nemesis}: {_outcome(report)}", file=sys.stderr
        )
        self._update(f"after fault {report.number}")

    def _update(self, text: str) -> None:
        self._bar.set_description_str(text, refresh=False)
        self._bar.n = min(self._bar.total, time.monotonic() - self._begun)
        self._bar.refresh()


def _outcome(report: FaultReport) -> str:
    recovered = "never" if report.recovered_s is None else f"{report.recovered_s:.1f} s"
    return (
        f"recovered in {recovered}, {report.cells_lost} cells lost, "
        f"{len(report.violations)} violations"
    )
