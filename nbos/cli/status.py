"""``nbos status``: the gateway's hosts, GPUs by state, kernels (and their states) and
replicas, as tables."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import anyio

from nbos.core.config import Settings
from nbos.core.errors import TransportError
from nbos.gateway.control_api import ClusterStatus, ControlError, StatusRequest, call


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the gateway's hosts, GPUs, kernels and replicas",
        description="Ask the gateway at [gateway] address (or a cluster file's) for its "
        "state and print it.",
    )
    parser.add_argument(
        "--cluster", metavar="FILE", help="the gateway of this cluster file (nbos cluster up)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="how long to wait (default 10)"
    )
    parser.set_defaults(func=status_command)


def status_command(args: argparse.Namespace) -> int:
    if args.cluster:
        from nbos.deploy import load_cluster_file

        address = load_cluster_file(args.cluster).gateway.address
    else:
        address = Settings.load(args.config).gateway.address
    reply = anyio.run(call, address, StatusRequest(), args.timeout)
    if isinstance(reply, ControlError):
        raise TransportError(f"the gateway refused: {reply.message}")
    if not isinstance(reply, ClusterStatus):
        raise TransportError(f"the gateway answered {type(reply).__name__}")
    print(render(reply))
    return 0


def render(status: ClusterStatus) -> str:
    """The status as three plain-text tables: hosts, kernels, replicas."""
    hosts = table(
        ["HOST", "ADDRESS", "STATE", "GPUS", "IDLE", "PRE-COMMITTED", "COMMITTED", "RESIDENT"],
        [
            [h.host_id, h.address, h.state, h.gpus, h.idle, h.precommitted, h.committed, h.resident]
            for h in status.hosts
        ],
    )
    kernels = table(
        ["KERNEL", "USER", "STATE", "ALIVE", "LAST CELL", "RUNNING ON"],
        [
            [
                k.kernel_id,
                k.owner or "-",
                k.state or "-",
                f"{sum(r.alive for r in k.replicas)}/{len(k.replicas)}",
                k.last_exec_index,
                "-" if k.running_on is None else k.running_on,
            ]
            for k in status.kernels
        ],
    )
    replicas = table(
        ["KERNEL", "NODE", "HOST", "IP", "PID", "ALIVE"],
        [
            [k.kernel_id, r.node, r.host, r.ip, r.pid or "-", "yes" if r.alive else "no"]
            for k in status.kernels
            for r in k.replicas
        ],
    )
    return f"{hosts}\n\n{len(status.kernels)} kernels\n{kernels}\n\n{replicas}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )
