"""``nbos replay``: drive a live cluster with a session trace and print ``nbos simulate``'s table.

Without ``--gateway`` it runs an embedded gateway (``nbos gateway`` in this process,
with ``--hosts`` local agents and, unless ``--no-autoscale``, the ``local`` host
provider) whose autoscaler runs with the simulator's defaults scaled down by
``--speedup``: a tick of 60 s of trace time, cooldowns of 120 s and 600 s, hosts idle
for 600 s drained. ``--simulate`` adds the simulator's column for the same trace and
cluster. What the kernels say of each cell (nbos's waiting-for-GPUs lines) goes to stderr
a line each, and the progress too: a bar on a terminal, else a line every
``--progress-every`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator

import anyio
import msgspec

from nbos.cli._progress import progress_bar
from nbos.cli.simulate import (
    add_spare_hosts_argument,
    add_timings_argument,
    add_trace_arguments,
    autoscaler_config,
    fair_share,
    load,
    show,
    timings,
)
from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.gateway.replay import ReplayConfig, ReplayProgress, ReplayWatch, replay
from nbos.scaling.autoscaler import AutoscalerConfig
from nbos.scaling.fair_share import FairShare
from nbos.scaling.results import SimResult
from nbos.scaling.simulator import SimConfig, simulate
from nbos.scaling.trace import Trace


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` subcommand; its handler is set as ``func``."""
    p = subparsers.add_parser(
        "replay",
        help="replay a notebook session trace on a live cluster, sped up",
        description=(
            "Run a trace's sessions as kernels and its cells as sleeps holding their GPUs, "
            "SPEEDUP times faster than the trace, on a running gateway or an embedded one, "
            "and print the metrics of nbos simulate from the gateway's own accounting."
        ),
    )
    add_trace_arguments(p)
    p.add_argument("--speedup", type=float, default=60.0, help="trace seconds per real second (60)")
    p.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        help="a running gateway's control address (default: an embedded gateway)",
    )
    p.add_argument("--policy", default="least-loaded", help="embedded: placement policy")
    p.add_argument("--hosts", type=int, default=4, help="embedded: hosts at the start (4)")
    p.add_argument("--gpus-per-host", type=int, default=8, help="embedded: GPUs per host (8)")
    p.add_argument("--no-autoscale", action="store_true", help="embedded: keep --hosts hosts")
    p.add_argument("--max-hosts", type=int, default=64, help="embedded: host ceiling (64)")
    add_spare_hosts_argument(p, "embedded and simulated autoscaler")
    p.add_argument(
        "--precopy",
        action="store_true",
        help="embedded and simulated: copy replicas of idle kernels ahead of their next cell",
    )
    p.add_argument(
        "--simulate", action="store_true", help="also simulate the trace (nbos mode) alongside"
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="S",
        help="without a terminal on stderr, a progress line every S real seconds (30)",
    )
    add_timings_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per column")
    p.add_argument("--plot", metavar="FILE", help="draw the columns as nbos simulate --plot")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Replay the trace ``args`` name and print the results."""
    trace = load(args)
    quotas = fair_share(args)
    durations = timings(args)  # read first: a bad file stops the run before it starts
    autoscaler = autoscaler_config(args)  # and bad autoscaler options
    config = ReplayConfig(speedup=args.speedup, policy=args.policy, fair_share=quotas)
    with _watch(trace, args.progress_every) as watch:
        if args.gateway:
            result = anyio.run(replay, trace, args.gateway, config, watch)
        else:
            result = anyio.run(_embedded, trace, _settings(args), config, watch)
    results = [result]
    if args.simulate:
        timed = _sim_config(args, quotas, autoscaler).replaying(durations, args.speedup)
        results.insert(0, simulate(trace, timed))
    show(results, args, "its host ceiling", trace.names_users or quotas is not None)
    return 0


async def _embedded(
    trace: Trace, settings: Settings, config: ReplayConfig, watch: ReplayWatch
) -> SimResult:
    from nbos.gateway.service import GatewayService

    # A gateway of its own, for this replay: nothing it started outlives it.
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        return await replay(trace, service.control_address, config, watch)


@contextlib.contextmanager
def _watch(trace: Trace, every: float) -> Iterator[ReplayWatch]:
    """What the kernels say, a line each, and the progress on stderr: a bar of trace hours
    on a terminal (with tqdm), else a line every ``every`` seconds."""
    if not (math.isfinite(every) and every > 0):
        raise ConfigError("--progress-every", every, "positive seconds")
    with progress_bar(max(1, round(trace.end / 3600)), "replaying", "h") as bar:
        if bar is None:
            yield ReplayWatch(_say, lambda p: _say(p.line()), every)
            return

        def advance(progress: ReplayProgress) -> None:
            hours = min(bar.total, int(progress.trace_time // 3600))
            if hours > bar.n:
                bar.update(hours - bar.n)

        yield ReplayWatch(bar.write, advance, min(every, 1.0))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace) -> Settings:
    """The embedded gateway's settings: ``--config`` and ``NBOS_*``, then the options."""
    from nbos.transport.ports import free_loopback_ports

    k = args.speedup
    if not k > 0:
        raise ConfigError("--speedup", k, "a positive number")
    if args.precopy and args.no_autoscale:
        raise ConfigError("--precopy", True, "without --no-autoscale (its period runs it)")
    base = Settings.load(args.config)
    control, agents = free_loopback_ports(2)
    cluster = msgspec.structs.replace(
        base.cluster,
        hosts=args.hosts,
        gpus_per_host=args.gpus_per_host,
        placement_policy=args.policy,
    )
    gateway = msgspec.structs.replace(
        base.gateway,
        address=f"127.0.0.1:{control}",
        agent_address=f"127.0.0.1:{agents}",
        local_agents=True,
    )
    if not args.no_autoscale:
        defaults, tick = AutoscalerConfig(), SimConfig().tick
        gateway = msgspec.structs.replace(
            gateway,
            autoscale=True,
            min_hosts=min(defaults.min_hosts, args.max_hosts),
            max_hosts=args.max_hosts,
            autoscale_period_s=tick / k,
            scale_out_cooldown_s=defaults.scale_out_cooldown / k,
            scale_in_cooldown_s=defaults.scale_in_cooldown / k,
            idle_grace_s=defaults.idle_grace / k,
            spare_hosts=args.spare_hosts,
            precopy=args.precopy,
        )
    return msgspec.structs.replace(base, cluster=cluster, gateway=gateway)


def _sim_config(
    args: argparse.Namespace, quotas: FairShare | None, autoscaler: AutoscalerConfig | None
) -> SimConfig:
    return SimConfig(
        hosts=args.hosts,
        gpus_per_host=args.gpus_per_host,
        mode="nbos",
        policy=args.policy,
        autoscaler=autoscaler,
        fair_share=quotas,
        precopy=args.precopy,
    )
