"""``nbos_member_request``: the front changes a kernel's Raft membership through a replica.

A replacement replica joins as a learner, is promoted once it caught up, and the dead
member it replaces is removed. Only the Raft leader can make those changes, so the
request goes to any live replica: the leader makes the change, any other replica
answers ``NotLeaderError`` with the leader it knows of, and the caller asks that one.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec

from nbos.core.errors import NotLeaderError, ReplicationError
from nbos.core.ids import NodeId
from nbos.kernel.replica._member_thread import RaftMemberThread

log = logging.getLogger(__name__)

MemberOp = Literal["add_learner", "promote", "remove", "members"]


class MemberRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The content of an ``nbos_member_request``: a Raft membership change of ``node``
    (``add_learner`` needs its Raft address, ``raft``), or ``members``: none, the
    leader's voters and learners only."""

    op: MemberOp
    node: Annotated[int, msgspec.Meta(ge=0)] = 0
    raft: str = ""

    def __post_init__(self) -> None:
        if self.op == "add_learner" and not self.raft:
            raise ValueError("add_learner needs the Raft address")
        if self.op != "members" and self.node == 0:
            raise ValueError(f"{self.op} needs a node above 0")


async def member_reply(raft: RaftMemberThread, content: Any) -> dict[str, Any]:
    """Carry out one ``nbos_member_request``; the reply content.

    ``{"status": "ok", "voters", "learners"}`` once the change applied here (a change
    already made is a success: the caller retries), otherwise ``status: "error"``
    with ``ename``/``evalue`` and, for ``NotLeaderError``, ``leader`` (may be ``None``).
    """
    try:
        request = msgspec.convert(content, MemberRequest)
        voters, learners = await raft.change_members(
            request.op, NodeId(request.node), request.raft or None
        )
    except msgspec.ValidationError as exc:
        log.warning("nbos_member_request refused: %s", exc)
        return _error(exc)
    except NotLeaderError as exc:
        return {**_error(exc), "leader": exc.leader_hint}
    except ReplicationError as exc:
        log.info("nbos_member_request %s failed: %s", content, exc)
        return _error(exc)
    return {"status": "ok", "voters": list(voters), "learners": list(learners)}


def _error(exc: Exception) -> dict[str, Any]:
    return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc), "traceback": []}
