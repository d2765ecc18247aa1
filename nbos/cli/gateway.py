"""``nbos gateway``: the cluster's daemon, in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from nbos.core.config import Settings
from nbos.core.private_files import keep_private

if TYPE_CHECKING:
    from nbos.gateway.service import GatewayService


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the cluster's gateway: hosts, GPU scheduler, every kernel, control API",
        description="Run the gateway in the foreground until SIGINT or SIGTERM. Without a "
        "[cluster] data_dir its exit shuts its kernels, replicas and local agents down; with "
        "one, any exit (a signal, a crash) leaves them running and its state file as it is, "
        "for its next start to take back, unless --shutdown-kernels-on-exit; the control "
        "request ShutdownCluster (nbos cluster down) shuts every kernel down and then the "
        "gateway. Settings: [gateway] "
        "(address, agent_address, keys, heartbeat_s, missed_heartbeats, local_agents, "
        "http_address, auth_token, http_certfile, http_keyfile, cull_idle_timeout), "
        "[cluster] (hosts, gpus_per_host, placement_policy, data_dir) and [store]. "
        "With a data_dir the gateway keeps its kernels there: started again after a stop, a "
        "crash or kill -9, it takes them back (agents and replicas run on). With [gateway] "
        "idle_exit_s it also exits once it has had no kernel for that long. Once every "
        "endpoint listens it prints one line to stderr, 'nbos gateway: ready: control "
        "HOST:PORT, agents HOST:PORT[, http URL][, metrics URL]', at any --log-level. "
        "See docs/deploy.md and docs/jupyter.md.",
    )
    parser.add_argument(
        "--runtime-file",
        metavar="PATH",
        help="announce the control address in PATH while serving (how the nbos kernelspec "
        "finds the per-user gateway it started; see docs/jupyter.md)",
    )
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve the Jupyter Kernel Gateway API (jupyter server --gateway-url) there; "
        "sets [gateway] http_address",
    )
    parser.add_argument(
        "--shutdown-kernels-on-exit",
        action="store_true",
        help="shut every kernel, replica and local agent down when the gateway exits, as a "
        "gateway without a data_dir does (default with a data_dir: leave them running)",
    )
    parser.set_defaults(func=gateway_command)


def gateway_command(args: argparse.Namespace) -> int:
    # Imported here: every nbos command builds this parser, few need the kernel stack.
    from nbos.gateway.service import run_until_signalled

    settings = Settings.load(args.config)
    if args.http is not None:
        gateway = msgspec.structs.replace(settings.gateway, http_address=args.http)
        settings = msgspec.structs.replace(settings, gateway=gateway)
    runtime_file = Path(args.runtime_file) if args.runtime_file else None
    keep_private()
    anyio.run(
        partial(
            run_until_signalled,
            settings,
            runtime_file,
            shutdown_kernels_on_exit=args.shutdown_kernels_on_exit,
            on_ready=print_ready,
        )
    )
    return 0


def print_ready(service: GatewayService) -> None:
    """The one line a person starting the gateway waits for: it serves, and where."""
    where = ", ".join(f"{name} {address}" for name, address in service.addresses.items())
    print(f"nbos gateway: ready: {where}", file=sys.stderr, flush=True)
