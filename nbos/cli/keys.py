"""``nbos keys DIR HOST... [--join-token]``: CURVE key pairs for a cluster's gateway and hosts,
and the join token with which agents join with key pairs of their own."""

from __future__ import annotations

import argparse
from typing import Any

from nbos.transport.join import make_join_token
from nbos.transport.keys import generate_keys


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="make CURVE key pairs for a cluster's gateway and hosts, or its join token",
        description="Make the gateway's key pair and one per HOST in DIR (ZeroMQ certificate "
        "files, mode 0600). Pairs that exist are kept, so a new host is one more call. "
        "With --join-token, also DIR/join.token (kept if it exists): agents given it make "
        "their own key pairs and join the gateway. See docs/deploy.md for which file goes "
        "where.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("hosts", nargs="*", metavar="HOST", help="host names, as in --host")
    parser.add_argument(
        "--join-token",
        action="store_true",
        help="write DIR/join.token (mode 0600) for agents that join with their own keys",
    )
    parser.set_defaults(func=keys_command)


def keys_command(args: argparse.Namespace) -> int:
    for path in generate_keys(args.directory, args.hosts):
        print(path)
    if args.join_token:
        path, new = make_join_token(args.directory)
        print(path if new else f"{path} (kept)")
    return 0
