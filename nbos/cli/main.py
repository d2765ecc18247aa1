"""The ``nbos`` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

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
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbos",
        description="Replicated, GPU-on-demand Jupyter kernels over a cluster of GPU hosts.",
    )
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
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        importlib.import_module(f"nbos.cli.{module}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
