"""``nbos users add NAME --file USERS``: a user and a fresh token, for a users file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nbos.core.errors import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "users",
        help="add users to a users file ([auth] users_file)",
        description="Add a user with a fresh token to a users file (created 0600): the file "
        "keeps the token's hash, the token is printed once. A running gateway reads the "
        "change by itself. See docs/users.md.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="add a user; print their token")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--file", required=True, metavar="USERS", help="the users file (TOML)")
    add.add_argument("--role", choices=["user", "admin"], default="user")
    add.add_argument("--quota", type=int, metavar="GPUS", help="guaranteed GPUs (default: [auth])")
    add.set_defaults(func=add_command)


def add_command(args: argparse.Namespace) -> int:
    from nbos.core.config import convert_strictly
    from nbos.core.identity import User, new_token
    from nbos.core.private_files import open_private
    from nbos.gateway.auth import UsersFile, users_file_entry

    path = Path(args.file)
    quota = 0 if args.quota is None else args.quota
    convert_strictly({"name": args.name, "role": args.role, "quota": quota}, User)
    known = {u.name for u in UsersFile(path).users} if path.exists() else set()
    if args.name in known:
        raise ConfigError("name", args.name, f"a user not yet in {path}")
    token = new_token()
    entry = users_file_entry(args.name, token, args.role, args.quota)
    with open_private(path) as f:
        f.write(("\n" if known else "").encode() + entry.encode())
    UsersFile(path)  # what was written reads back, or this says why not
    print(token)
    return 0
