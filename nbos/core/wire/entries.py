"""Entries of a kernel's replicated log (the path of one cell, steps 4 to 6).

Every replica applies the same entries in the same order, so each rule below
holds on all of them alike:

* the first committed :class:`Claim` for an index names the only replica that runs it;
* the first committed :class:`Done` for an index counts; a later one is ignored;
* the cell's state (a :class:`~nbos.core.wire.state.StateDelta`) rides in its ``Done`` and
  takes effect only when that ``Done`` counts, comes from the claim winner and has
  status ``ok`` or ``error``;
* :class:`CommEntry` carries a widget (comm) message from a client to every replica.
"""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message
from nbos.core.wire.state import StateDelta

CellStatus = Literal["ok", "error", "aborted", "lost"]


class Claim(Message):
    """Replica ``replica`` claims cell ``exec_index``; the first committed claim wins."""

    exec_index: int
    replica: int


class Done(Message):
    """Cell ``exec_index`` finished; the first committed ``Done`` for an index counts.

    ``execution_count`` is the shell's prompt counter after the cell; a ``lost`` cell
    leaves the counter where it was. ``code`` is the cell's source when it goes into
    the input history (empty otherwise), so every replica can answer history requests.
    ``state`` is what the cell changed (``None``: nothing). It rides in the ``Done``
    rather than in an entry of its own; large values are object-store pointers, so the
    entry stays small. With ``claim_next``, a ``Done`` that counts also claims cell
    ``exec_index + 1`` for its replica (unless it is claimed already): the executor of
    a kernel's next cell is usually the same, and a cell then costs one consensus round.
    """

    exec_index: int
    replica: int
    execution_count: int
    status: CellStatus
    code: str = ""
    state: StateDelta | None = None
    claim_next: bool = False


class CommEntry(Message):
    """A client's comm message (``comm_open``, ``comm_msg``, ``comm_close``) for every replica.

    ``message`` is the JSON of the Jupyter message's header, metadata and content;
    ``buffers`` are its binary buffers.
    """

    replica: int
    message: bytes
    buffers: list[bytes] = []


KernelEntry = Claim | Done | CommEntry
