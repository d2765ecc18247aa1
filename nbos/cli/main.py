"""The ``nbos`` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from nbos._version import __version__
from nbos.core.errors import NbosError

log = logging.getLogger(__name__)

#: Each subcommand module exposes ``register(subparsers)``; it sets ``func`` on its parser.
Handler = Callable[[argparse.Namespace], int]

_COMMANDS = (
    "run",
    "kernelspec",
    "simulate",
    "keys",
    "agent",
    "chaos",
    "gateway",
    "status",
    "cluster",
    "replay",
    "calibrate",
    "users",
    "swarm",
)


def build_parser(commands: Sequence[str] = _COMMANDS) -> argparse.ArgumentParser:
    """The parser of ``commands`` (each imports its module: all for help and errors)."""
    parser = _global_options(
        argparse.ArgumentParser(
            prog="nbos",
            description="Replicated, GPU-on-demand Jupyter kernels over a cluster of GPU hosts.",
        )
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in commands:
        importlib.import_module(f"nbos.cli.{module}").register(subparsers)
    return parser


def _global_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--version", action="version", version=f"nbos {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level for nbos's own messages (default: WARNING)",
    )
    parser.add_argument("--config", help="TOML settings file (NBOS_* variables override it)")
    parser.add_argument(
        "--token",
        help="your token for the gateway's control endpoint (default: $NBOS_TOKEN, else the "
        "operator token a gateway you run left in Jupyter's runtime directory)",
    )
    return parser


def _named_command(argv: Sequence[str] | None) -> list[str]:
    """The command ``argv`` names, alone: a daemon imports its own command's code only
    (every command's would cost each ``nbos agent`` some 25 MiB); all of them when it
    names none (help, errors)."""
    before = _global_options(_Peek(add_help=False))
    before.add_argument("command", nargs="?")
    try:
        known, _ = before.parse_known_args(argv)
    except _Unparsed:  # the whole parser says what is wrong
        return list(_COMMANDS)
    return [known.command] if known.command in _COMMANDS else list(_COMMANDS)


class _Unparsed(Exception):
    pass


class _Peek(argparse.ArgumentParser):
    """A parser that raises on bad arguments instead of printing them and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _Unparsed(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(_named_command(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.token:
        from nbos.gateway.auth import TOKEN_ENV

        # Where every control client of this process looks (nbos.gateway.auth.client_token).
        os.environ[TOKEN_ENV] = args.token
    func: Handler | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return func(args)
    except NbosError as exc:
        log.debug("command failed", exc_info=True)
        print(f"nbos: error: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # Task groups wrap what their tasks raise: nbos's own errors still read as one line.
        errors, rest = group.split(NbosError)
        if errors is None or rest is not None:
            raise
        log.debug("command failed", exc_info=True)
        for error in _leaves(errors):
            print(f"nbos: error: {error}", file=sys.stderr)
        return 1


def _leaves(group: BaseExceptionGroup[NbosError]) -> list[NbosError]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


if __name__ == "__main__":
    sys.exit(main())
