"""``nbos chaos``: break a replicated kernel on purpose, check it keeps its promises."""

from __future__ import annotations

import argparse
import contextlib
import os
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
    CpuHog,
    EmbeddedKernel,
    FaultReport,
    FillDisk,
    FreezeAgent,
    FreezeGateway,
    GatewayKernel,
    HttpApi,
    KillAgent,
    KillGateway,
    LocalGateway,
    MalformedRequests,
    Nemesis,
    Observer,
    PartitionHost,
    PlannedFault,
    StartFlood,
    Strike,
    check_supported,
    default_nemeses,
    known_nemeses,
    run_chaos,
)
from nbos.cli._progress import progress_bar
from nbos.cluster import LocalCluster
from nbos.core.config import Settings
from nbos.core.errors import ConfigError, NemesisUnsupportedError
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
            "an agent, cutting a host off, stopping it or an agent, a CPU hog, a full disk, "
            "a flood of starts, malformed requests) strikes, and print one line per fault "
            "and one per nemesis with the invariants checked. Exits 1 if any check "
            "failed. See docs/chaos.md."
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
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="with --gateway: its [cluster] data_dir on this machine (adds fill-disk, as root)",
    )
    p.add_argument(
        "--http",
        metavar="URL",
        help="with a gateway: its Jupyter Kernel Gateway API (http://HOST:PORT); start-flood "
        "sends every other start there as POST /api/kernels",
    )
    p.add_argument("--http-token", metavar="TOKEN", help="the --http API's auth_token")
    p.add_argument(
        "--bystanders",
        type=int,
        metavar="N",
        help="kernels started beside the one under test, each checked after every fault to "
        "be listed, run a cell and keep its state (default: 1 with a gateway, else 0)",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the report as JSON to FILE (each fault, each nemesis, invariants)",
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
    bystanders: int


def run(args: argparse.Namespace) -> int:
    """Run the chaos session ``args`` describe; 0 if no check failed."""
    settings = Settings.load(args.config)
    target = _target(args)  # refused before a cluster starts for nothing
    hosts = args.hosts or settings.cluster.hosts
    report = anyio.run(_chaos, target, hosts, settings, args)
    print(report.table())
    if args.json is not None:
        args.json.write_text(report.json() + "\n")
    return 0 if report.ok else 1


def _target(args: argparse.Namespace) -> _Target:
    address: str | None = args.gateway
    offers = EMBEDDED
    processes = network = None
    data_dir: Path | None = args.data_dir
    if args.cluster is not None:
        processes = DeployedCluster(args.cluster)
        address = processes.address
        offers |= {"gateway-processes"}
        if data_dir is not None:
            raise ConfigError("--data-dir", str(data_dir), "--gateway (a cluster file names it)")
        data_dir = _cluster_data_dir(processes)
    if (args.partition_command is None) != (args.heal_command is None):
        raise ConfigError("--heal-command", args.heal_command, "given with --partition-command")
    if args.partition_command is not None:
        if address is None:
            raise ConfigError("--partition-command", args.partition_command, "a gateway")
        network = CommandNetwork(args.partition_command, args.heal_command)
        offers |= {"partition"}
    if address is not None and args.hosts is not None:
        raise ConfigError("--hosts", args.hosts, "the embedded cluster (no --gateway, --cluster)")
    if address is None and data_dir is not None:
        raise ConfigError("--data-dir", str(data_dir), "a gateway (--gateway)")
    if args.http is not None and address is None:
        raise ConfigError("--http", args.http, "a gateway (--gateway, --cluster)")
    if args.http_token is not None and args.http is None:
        raise ConfigError("--http-token", "...", "given with --http")
    http = HttpApi(args.http, args.http_token or "") if args.http is not None else None
    if args.bystanders is not None and args.bystanders < 0:
        raise ConfigError("--bystanders", args.bystanders, "0 or more")
    local = LocalGateway.find(address) if address is not None else None
    offers |= _control_plane_offers(address, local, data_dir)
    every = (
        *default_nemeses(),
        PartitionHost(network),
        KillGateway(processes),
        KillAgent(processes),
        FreezeGateway(local),
        FreezeAgent(local),
        CpuHog(),
        FillDisk(data_dir, address),
        StartFlood(address, http=http),
        MalformedRequests(address),
    )
    where = "embedded cluster" if address is None else f"gateway at {address}"
    if args.nemesis:
        by_name = {n.name: n for n in every}
        chosen = tuple(by_name[name] for name in args.nemesis)
        check_supported(chosen, offers, where)
    else:
        chosen = tuple(n for n in every if n.needs <= offers)
        if address is not None:  # say why a gateway's nemesis is left out
            for n in every:
                if not n.needs <= offers:
                    skipped = NemesisUnsupportedError(n.name, sorted(n.needs - offers), where)
                    print(f"skipped: {skipped}", file=sys.stderr)
    bystanders = args.bystanders if args.bystanders is not None else int(address is not None)
    return _Target(address, offers, chosen, bystanders)


def _control_plane_offers(
    address: str | None, local: LocalGateway | None, data_dir: Path | None
) -> frozenset[Capability]:
    """What the control-plane nemeses need that this run has."""
    offers: set[Capability] = set()
    if address is not None:
        offers.add("gateway-control")
    if local is not None:
        offers.add("local-gateway")
    if data_dir is not None:
        offers.add("gateway-data-dir")
    if os.geteuid() == 0:
        offers.add("root")
    return frozenset(offers)


def _cluster_data_dir(processes: DeployedCluster) -> Path:
    """The ``[cluster] data_dir`` a cluster file gives its gateway."""
    cluster = processes.cluster
    settings = cluster.file.gateway_settings(cluster.base, cluster.run_dir)
    return Path(str(settings["cluster"]["data_dir"]))


async def _chaos(
    target: _Target, hosts: int, settings: Settings, args: argparse.Namespace
) -> ChaosReport:
    async with _kernels(target, hosts, settings) as (kernel, bystanders):
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
                bystanders=bystanders,
            )


@contextlib.asynccontextmanager
async def _kernels(
    target: _Target, hosts: int, settings: Settings
) -> AsyncIterator[tuple[ChaosKernel, list[ChaosKernel]]]:
    """A new kernel on the gateway named, else on an embedded cluster of ``hosts``; and
    ``target.bystanders`` more beside it."""
    async with contextlib.AsyncExitStack() as stack:
        kernels: list[ChaosKernel] = []
        if target.address is not None:
            for _ in range(1 + target.bystanders):
                start = GatewayKernel.start(target.address, target.offers)
                kernels.append(await stack.enter_async_context(start))
        else:
            cluster = await stack.enter_async_context(LocalCluster(hosts=hosts, settings=settings))
            for _ in range(1 + target.bystanders):
                kernels.append(EmbeddedKernel(await cluster.start_kernel()))
        yield kernels[0], kernels[1:]


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
