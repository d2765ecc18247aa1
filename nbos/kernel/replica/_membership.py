"""``nbos_member_request``: the front changes a kernel's Raft membership through a replica.

A replacement replica joins as a learner, is promoted once it caught up, and the dead
member it replaces is removed. Only the Raft leader can make those changes, so the
request goes to any live replica: the leader makes the change, any other replica
answers ``NotLeaderError`` with the leader it knows of, and the caller asks that one.

Every request also tells the replica where the new member's forwarder listens, so
proposals can be forwarded to it should it become the leader.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec

from nbos.core.errors import NotLeaderError, ReplicationError
from nbos.core.ids import NodeId
from nbos.kernel.replica._raftnode import PeerAddress, RaftNode

log = logging.getLogger(__name__)

MemberOp = Literal["peer", "add_learner", "promote", "remove"]


class MemberRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The content of an ``nbos_member_request``.

    ``peer`` only records the member's addresses; the others are Raft membership
    changes of ``node`` (``add_learner`` needs the addresses).
    """

    op: MemberOp
    node: Annotated[int, msgspec.Meta(gt=0)]
    raft: str = ""
    forward: str = ""

    def __post_init__(self) -> None:
        if self.op in ("peer", "add_learner") and self.address() is None:
            raise ValueError(f"{self.op} needs raft and forward addresses")

    def address(self) -> PeerAddress | None:
        return PeerAddress(self.raft, self.forward) if self.raft and self.forward else None


async def member_reply(raft: RaftNode, content: Any) -> dict[str, Any]:
    """Carry out one ``nbos_member_request``; the reply content.

    ``{"status": "ok", "voters", "learners"}`` once the change applied here (a change
    already made is a success: the caller retries), otherwise ``status: "error"``
    with ``ename``/``evalue`` and, for ``NotLeaderError``, ``leader`` (may be ``None``).
    """
    try:
        request = msgspec.convert(content, MemberRequest)
        voters, learners = await raft.change_members(
            request.op, NodeId(request.node), request.address()
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
