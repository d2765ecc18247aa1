"""A real small file system that the tests fill: a tmpfs mounted on a directory.

Mounting needs root (skipped otherwise). :func:`fill` writes a file of zeros until the
file system refuses with ``ENOSPC``; :func:`free_pages` gives some of it back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

#: tmpfs counts whole pages.
PAGE = os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` on ``where`` (made if missing) for the block; skips the test
    where it cannot be mounted (not root, no mount in a container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazy: a process the test failed to end may still hold a file there.
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Fill ``directory``'s file system: a file ``filler`` of zeros grown until ``ENOSPC``."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        page = bytes(PAGE)
        while True:
            try:
                os.write(fd, page)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return filler
    finally:
        os.close(fd)


def free_pages(filler: Path, pages: int) -> None:
    """Give ``pages`` pages of a full file system back (shrink ``filler``)."""
    kept = max(filler.stat().st_size // PAGE - pages, 0)
    os.truncate(filler, kept * PAGE)


def pages_for(size: int) -> int:
    return -(-size // PAGE)
