"""``nbos cluster up|restart|down FILE``: a cluster file's gateway and agents."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from nbos.core.private_files import keep_private


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="start, restart or stop the gateway and agents a cluster file names",
        description="up: make the CURVE keys, start the gateway and every host's agent "
        "(locally, over SSH or in a container on the host's Docker engine) that does not "
        "run yet, wait until every host is up and print the status. restart: stop and "
        "start the gateway or one host's agent; kernels run on through it. down: shut "
        "every kernel down, then stop the gateway and the agents. What runs is recorded "
        "in the file's run directory. See docs/deploy.md.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the cluster")
    up.add_argument("file", metavar="FILE", help="the cluster file (TOML)")
    up.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="wait for the hosts (120)"
    )
    up.set_defaults(func=up_command)
    restart = actions.add_parser(
        "restart", help="restart the gateway or one host's agent (kernels run on)"
    )
    restart.add_argument("file", metavar="FILE", help="the cluster file (TOML)")
    restart.add_argument(
        "target", metavar="gateway|HOST", help="'gateway', or the name of a host of the file"
    )
    restart.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="wait for the hosts (120)"
    )
    restart.set_defaults(func=restart_command)
    down = actions.add_parser("down", help="stop the cluster")
    down.add_argument("file", metavar="FILE", help="the cluster file (TOML)")
    down.set_defaults(func=down_command)


def up_command(args: argparse.Namespace) -> int:
    # Imported here: every nbos command builds this parser, few need the gateway's client.
    from nbos.cli.status import render
    from nbos.deploy import cluster_up

    keep_private()  # the daemons' logs it creates
    print(render(anyio.run(cluster_up, args.file, args.timeout)))
    return 0


def restart_command(args: argparse.Namespace) -> int:
    from nbos.cli.status import render
    from nbos.deploy import cluster_restart

    keep_private()
    print(render(anyio.run(cluster_restart, args.file, args.target, args.timeout)))
    return 0


def down_command(args: argparse.Namespace) -> int:
    from nbos.deploy import cluster_down

    stopped = anyio.run(cluster_down, args.file)
    print(f"stopped: {', '.join(stopped) or 'nothing (not up)'}")
    return 0
