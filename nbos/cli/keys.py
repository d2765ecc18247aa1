"""``nbos keys DIR HOST...``: CURVE key pairs for the gateway and each host of a cluster."""

from __future__ import annotations

import argparse
from typing import Any

from nbos.transport.keys import generate_keys


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="make CURVE key pairs for a cluster's gateway and hosts",
        description="Make the gateway's key pair and one per HOST in DIR (ZeroMQ certificate "
        "files, mode 0600). Pairs that exist are kept, so a new host is one more call. "
        "See docs/deploy.md for which file goes where.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("hosts", nargs="*", metavar="HOST", help="host names, as in --host")
    parser.set_defaults(func=keys_command)


def keys_command(args: argparse.Namespace) -> int:
    for path in generate_keys(args.directory, args.hosts):
        print(path)
    return 0
