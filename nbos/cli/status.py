"""``nbos status``: the gateway's hosts, GPUs by state, kernels (and their states) and
replicas, as tables or as JSON."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from nbos.core.config import Settings
from nbos.core.errors import TransportError
from nbos.gateway.control_api import (
    ClusterStatus,
    ControlError,
    KernelInfo,
    StatusRequest,
    call,
)


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
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the gateway's reply as one JSON object ({hosts: [...], kernels: [...]}, "
        "the control API's fields, each kernel with its age_s) instead of tables",
    )
    parser.set_defaults(func=status_command)


def status_command(args: argparse.Namespace) -> int:
    if args.cluster:
        from nbos.deploy import load_cluster_file

        address = load_cluster_file(args.cluster).gateway.address
    else:
        address = Settings.load(args.config).gateway.address
    reply = anyio.run(call, address, StatusRequest(starts=True), args.timeout)
    if isinstance(reply, ControlError) and reply.kind == "malformed" and "starts" in reply.message:
        reply = anyio.run(call, address, StatusRequest(), args.timeout)  # a gateway before it
    if isinstance(reply, ControlError):
        raise TransportError(f"the gateway refused: {reply.message}")
    if not isinstance(reply, ClusterStatus):
        raise TransportError(f"the gateway answered {type(reply).__name__}")
    print(as_json(reply, time.time()) if args.json else render(reply))
    return 0


def as_json(status: ClusterStatus, now: float) -> str:
    """The status as JSON: the control API's fields (less its type tags), with ages."""
    plain = _untagged(msgspec.to_builtins(status))
    plain["kernels"] = [_kernel_json(kernel, now) for kernel in status.kernels]
    return json.dumps(plain, indent=2)


def _kernel_json(kernel: KernelInfo, now: float) -> dict[str, Any]:
    """Every field of ``kernel``, those at their defaults too (the wire leaves them out),
    and its age."""
    fields = {f.name: getattr(kernel, f.name) for f in msgspec.structs.fields(kernel)}
    plain: dict[str, Any] = _untagged(msgspec.to_builtins(fields))
    started = kernel.started_at
    plain["age_s"] = None if started is None else round(max(0.0, now - started), 1)
    return plain


def _untagged(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untagged(v) for k, v in value.items() if k != "t"}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value


def age(started_at: float | None, now: float) -> str:
    """How long ago ``started_at`` was, in its largest unit (``-``: not known)."""
    if started_at is None:
        return "-"
    seconds = int(max(0.0, now - started_at))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render(status: ClusterStatus, now: float | None = None) -> str:
    """The status as three plain-text tables: hosts, kernels (then, for each start waiting
    for a host, its id and why), replicas. A kernel is named
    by the id the HTTP API shows (JupyterLab's) where it has one; NBOS ID is the one the
    control requests take. Ages are to ``now`` (UNIX seconds; default: the clock's)."""
    now = time.time() if now is None else now
    hosts = table(
        ["HOST", "ADDRESS", "STATE", "GPUS", "IDLE", "PRE-COMMITTED", "COMMITTED", "RESIDENT"],
        [
            [h.host_id, h.address, h.state, h.gpus, h.idle, h.precommitted, h.committed, h.resident]
            for h in status.hosts
        ],
    )
    kernels = table(
        [
            "KERNEL",
            "NBOS ID",
            "USER",
            "STATE",
            "GPUS",
            "AGE",
            "ALIVE",
            "LAST CELL",
            "RUNNING ON",
        ],
        [
            [
                k.api_id or k.kernel_id,
                k.kernel_id,
                k.owner or "-",
                k.state or "-",
                "-" if k.gpus is None else k.gpus,
                age(k.started_at, now),
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
            [
                k.api_id or k.kernel_id,
                r.node,
                r.host,
                r.ip,
                r.pid or "-",
                "yes" if r.alive else "no",
            ]
            for k in status.kernels
            for r in k.replicas
        ],
    )
    waiting = "".join(
        f"\n{k.api_id or k.kernel_id} {k.waiting}" for k in status.kernels if k.waiting
    )
    return f"{hosts}\n\n{len(status.kernels)} kernels\n{kernels}{waiting}\n\n{replicas}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )
