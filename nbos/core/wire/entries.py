"""Entries of a kernel's replicated log (the path of one cell, steps 4 to 6).

Every replica applies the same entries in the same order, so each rule below
holds on all of them alike:

* the first committed :class:`Claim` for an index names the only replica that runs it;
* :class:`~nbos.core.wire.state.StateDelta` entries count only for a claimed index whose
  ``Done`` has not committed yet; they take effect when the claim winner's ``Done``
  commits with status ``ok`` or ``error``, and are dropped otherwise;
* the first committed :class:`Done` for an index counts; a later one is ignored;
* :class:`CommEntry` carries a widget (comm) message from a client to every replica.
"""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message

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
    """

    exec_index: int
    replica: int
    execution_count: int
    status: CellStatus
    code: str = ""


class CommEntry(Message):
    """A client's comm message (``comm_open``, ``comm_msg``, ``comm_close``) for every replica.

    ``message`` is the JSON of the Jupyter message's header, metadata and content;
    ``buffers`` are its binary buffers.
    """

    replica: int
    message: bytes
    buffers: list[bytes] = []


KernelEntry = Claim | Done | CommEntry
