"""The ``nbos`` command-line interface (composition layer)."""

from nbos.cli.main import main

__all__ = ["main"]
