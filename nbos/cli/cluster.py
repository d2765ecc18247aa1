"""``nbos cluster up|down FILE``: a cluster file's gateway and agents, started and stopped."""

from __future__ import annotations

import argparse
from typing import Any

import anyio


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="start or stop the gateway and agents a cluster file names",
        description="up: make the CURVE keys, start the gateway and every host's agent "
        "(locally, over SSH or in a container on the host's Docker engine), wait until "
        "every host is up and print the status. down: stop them (the gateway first, its "
        "kernels with it). What runs is recorded in the file's run directory. "
        "See docs/deploy.md.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the cluster")
    up.add_argument("file", metavar="FILE", help="the cluster file (TOML)")
    up.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="wait for the hosts (120)"
    )
    up.set_defaults(func=up_command)
    down = actions.add_parser("down", help="stop the cluster")
    down.add_argument("file", metavar="FILE", help="the cluster file (TOML)")
    down.set_defaults(func=down_command)


def up_command(args: argparse.Namespace) -> int:
    # Imported here: every nbos command builds this parser, few need the gateway's client.
    from nbos.cli.status import render
    from nbos.deploy import cluster_up

    print(render(anyio.run(cluster_up, args.file, args.timeout)))
    return 0


def down_command(args: argparse.Namespace) -> int:
    from nbos.deploy import cluster_down

    stopped = anyio.run(cluster_down, args.file)
    print(f"stopped: {', '.join(stopped) or 'nothing (not up)'}")
    return 0
