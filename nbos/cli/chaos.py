"""``nbos chaos``: break a replicated kernel on purpose, check it keeps its promises."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs

from nbos.chaos import (
    EMBEDDED,
    Capability,
    ChaosKernel,
    ChaosReport,
    CommandNetwork,
    EmbeddedKernel,
    FaultReport,
    GatewayKernel,
    KillAgent,
    KillGateway,
    Nemesis,
    Observer,
    PartitionHost,
    PlannedFault,
    Strike,
    check_supported,
    default_nemeses,
    known_nemeses,
    run_chaos,
)
from nbos.cli._progress import progress_bar
from nbos.cluster import LocalCluster
from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.deploy import DeployedCluster

if TYPE_CHECKING:
    from tqdm import tqdm


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``chaos`` subcommand; its handler is set as ``func``."""
    names = [n.name for n in known_nemeses()]
    p = subparsers.add_parser(
        "chaos",
        help="inject faults into a replicated kernel and check exactly-once and consistency",
        description=(
            "Start a kernel on the embedded local cluster (or on a gateway: --gateway, "
            "--cluster), run a checked workload on it while a seeded schedule of faults "
            "(kill -9, SIGSTOP/SIGCONT, two kills at once; with a gateway, killing it or "
            "an agent, cutting a host off) strikes, and print one line per fault. Exits 1 "
            "if any check failed. See docs/chaos.md."
        ),
    )
    p.add_argument(
        "--duration", type=float, default=60.0, help="seconds after which no fault starts (60)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="schedule seed (0); a seed replays the same faults"
    )
    p.add_argument("--max-faults", type=int, metavar="N", help="stop after N faults")
    p.add_argument("--hosts", type=int, help="embedded: virtual hosts (default: config, 3)")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--gateway", metavar="ADDRESS", help="a kernel of the nbos gateway at HOST:PORT instead"
    )
    target.add_argument(
        "--cluster",
        type=Path,
        metavar="FILE",
        help="a kernel of the gateway of this cluster file, up (nbos cluster up FILE); "
        "adds kill-gateway and kill-agent",
    )
    p.add_argument(
        "--partition-command",
        metavar="CMD",
        help="with a gateway: a shell command that cuts host {host} off (adds partition-host)",
    )
    p.add_argument(
        "--heal-command", metavar="CMD", help="the shell command that undoes --partition-command"
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="where replicas record the cells they ran, at the same path on every host "
        "(default: a new directory on this machine)",
    )
    p.add_argument(
        "--nemesis",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"a fault to inject, repeatable (default: all the cluster can run): "
        f"{', '.join(names)}",
    )
    p.set_defaults(func=run)


@attrs.frozen
class _Target:
    """What the arguments name: a gateway (or none: embedded), and the nemeses."""

    address: str | None
    offers: frozenset[Capability]
    nemeses: tuple[Nemesis, ...]


def run(args: argparse.Namespace) -> int:
    """Run the chaos session ``args`` describe; 0 if no check failed."""
    settings = Settings.load(args.config)
    target = _target(args)  # refused before a cluster starts for nothing
    hosts = args.hosts or settings.cluster.hosts
    report = anyio.run(_chaos, target, hosts, settings, args)
    print(report.table())
    return 0 if report.ok else 1


def _target(args: argparse.Namespace) -> _Target:
    address: str | None = args.gateway
    offers = EMBEDDED
    processes = network = None
    if args.cluster is not None:
        processes = DeployedCluster(args.cluster)
        address = processes.address
        offers |= {"gateway-processes"}
    if (args.partition_command is None) != (args.heal_command is None):
        raise ConfigError("--heal-command", args.heal_command, "given with --partition-command")
    if args.partition_command is not None:
        if address is None:
            raise ConfigError("--partition-command", args.partition_command, "a gateway")
        network = CommandNetwork(args.partition_command, args.heal_command)
        offers |= {"partition"}
    if address is not None and args.hosts is not None:
        raise ConfigError("--hosts", args.hosts, "the embedded cluster (no --gateway, --cluster)")
    every = (
        *default_nemeses(),
        PartitionHost(network),
        KillGateway(processes),
        KillAgent(processes),
    )
    where = "embedded cluster" if address is None else f"gateway at {address}"
    if args.nemesis:
        by_name = {n.name: n for n in every}
        chosen = tuple(by_name[name] for name in args.nemesis)
        check_supported(chosen, offers, where)
    else:
        chosen = tuple(n for n in every if n.needs <= offers)
    return _Target(address, offers, chosen)


async def _chaos(
    target: _Target, hosts: int, settings: Settings, args: argparse.Namespace
) -> ChaosReport:
    async with _kernel(target, hosts, settings) as kernel:
        view = await kernel.view()
        placed = ", ".join(f"replica {n} on {h}" for n, h in sorted(view.hosts.items()))
        print(f"kernel {kernel.kernel_id}: {placed}; seed {args.seed}", file=sys.stderr)
        with _progress(args.duration) as observer:
            return await run_chaos(
                kernel,
                seed=args.seed,
                duration_s=args.duration,
                max_faults=args.max_faults,
                nemeses=target.nemeses,
                observer=observer,
                run_dir=args.run_dir,
            )


@contextlib.asynccontextmanager
async def _kernel(target: _Target, hosts: int, settings: Settings) -> AsyncIterator[ChaosKernel]:
    """A new kernel on the gateway named, else on an embedded cluster of ``hosts``."""
    if target.address is not None:
        async with GatewayKernel.start(target.address, target.offers) as kernel:
            yield kernel
        return
    async with LocalCluster(hosts=hosts, settings=settings) as cluster:
        yield EmbeddedKernel(await cluster.start_kernel())


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
