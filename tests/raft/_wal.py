"""Looking at WAL segment files from tests."""

from __future__ import annotations

from pathlib import Path

from nbos.raft.storage._framing import scan


def written(segment: Path) -> int:
    """Bytes of records in ``segment``: the open one is allocated ahead of them, with zeros."""
    return scan(segment.read_bytes()).valid_end
