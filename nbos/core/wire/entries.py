"""Entries of a kernel's replicated log (the path of one cell, steps 4 to 6)."""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message

CellStatus = Literal["ok", "error", "aborted", "lost"]


class Claim(Message):
    """Replica ``replica`` claims cell ``exec_index``; the first committed claim wins."""

    exec_index: int
    replica: int


class Done(Message):
    """Cell ``exec_index`` finished; the first committed ``Done`` for an index counts."""

    exec_index: int
    replica: int
    execution_count: int
    status: CellStatus


KernelEntry = Claim | Done
