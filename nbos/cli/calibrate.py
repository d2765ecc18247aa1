"""``nbos calibrate``: time nbos's own work on a live cluster and write the simulator's timings.

An embedded gateway (``--hosts`` local agents, the ``local`` host provider for the hosts
it starts) measures a kernel's start, a cell's GPU commit, a replica's migration and a
host's start, ``--samples`` times each with a line per sample on stderr, and writes their
medians to ``--out`` as the TOML that ``nbos simulate --timings`` and ``nbos replay
--simulate --timings`` read (``docs/simulator.md``, "Calibration").
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import anyio
import msgspec

from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.scaling.timings import Timings

#: A decision period no calibration lasts: the autoscaler adds and drains nothing itself.
_NO_DECISIONS_S = 86400.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``calibrate`` subcommand; its handler is set as ``func``."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure nbos's own durations on a live cluster for the simulator",
        description=(
            "Start an embedded gateway, time kernel starts, GPU commits, migrations and "
            "host starts, and write their medians as the simulator's timings (TOML)."
        ),
    )
    p.add_argument("--samples", type=int, default=5, help="measurements of each duration (5)")
    p.add_argument(
        "--out", default="nbos-timings.toml", help="the timings file to write (nbos-timings.toml)"
    )
    p.add_argument("--hosts", type=int, default=4, help="local hosts at the start (4)")
    p.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Calibrate, write ``--out`` and print it."""
    if args.samples < 1:
        raise ConfigError("--samples", args.samples, "an integer >= 1")
    settings = _settings(args)
    began = time.time()
    timings = anyio.run(_calibrate, settings, args.samples)
    text = timings.as_toml(
        f"nbos calibrate on {platform.node()}: medians of {args.samples} samples each, "
        f"{args.hosts} local hosts, {time.time() - began:.0f} s"
    )
    Path(args.out).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


async def _calibrate(settings: Settings, samples: int) -> Timings:
    from nbos.gateway.calibrate import calibrate
    from nbos.gateway.service import GatewayService

    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        return await calibrate(service, samples, _say)


def _say(what: str, sample: int, samples: int, seconds: float) -> None:
    print(f"calibrate: {what} {sample} of {samples}: {seconds:.3f} s", file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace) -> Settings:
    """An embedded gateway of ``--hosts`` local hosts whose autoscaler only starts the hosts
    calibration asks for."""
    from nbos.transport.ports import free_loopback_ports

    base = Settings.load(args.config)
    control, agents = free_loopback_ports(2)
    cluster = msgspec.structs.replace(
        base.cluster, hosts=args.hosts, gpus_per_host=args.gpus_per_host
    )
    gateway = msgspec.structs.replace(
        base.gateway,
        address=f"127.0.0.1:{control}",
        agent_address=f"127.0.0.1:{agents}",
        local_agents=True,
        autoscale=True,
        min_hosts=1,
        max_hosts=max(base.gateway.max_hosts, args.hosts + 1),
        autoscale_period_s=_NO_DECISIONS_S,
    )
    return msgspec.structs.replace(base, cluster=cluster, gateway=gateway)
