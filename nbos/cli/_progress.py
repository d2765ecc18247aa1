"""One progress bar for the long-running commands: tqdm on a terminal, else nothing.

The bar goes to stderr, so a command's table on stdout stays clean when piped.
Without a terminal (CI logs, pipes) or without tqdm (``pip install 'nbos[progress]'``)
:func:`progress_bar` yields ``None`` and callers print plain lines, or nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)


@contextlib.contextmanager
def progress_bar(total: float, desc: str, unit: str) -> Iterator[tqdm[None] | None]:
    """A bar of ``total`` ``unit`` on stderr when it is a terminal and tqdm is there."""
    if not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        log.debug("no progress bar: tqdm is not installed (pip install 'nbos[progress]')")
        yield None
        return
    with tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr) as bar:
        yield bar
