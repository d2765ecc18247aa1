"""What the Raft driver writes into ``kind="normal"`` entries around the application's data."""

from __future__ import annotations

from nbos.core.wire.base import Message


class Proposal(Message):
    """Application data with the proposer's session: ``(client_id, seq)`` applies once."""

    client_id: str
    seq: int
    data: bytes


class MemberAddress(Message):
    """How to reach node ``node``: its transport peer id and address (replicated to all)."""

    node: int
    peer: str
    address: str


class ClientSession(Message):
    """The last applied sequence number of one client and the result it got."""

    client_id: str
    seq: int
    result: bytes


class DriverSnapshot(Message):
    """A Raft snapshot image: the application's image plus the driver's replicated tables."""

    app: bytes
    sessions: list[ClientSession] = []
    members: list[MemberAddress] = []


LogCommand = Proposal | MemberAddress | ClientSession | DriverSnapshot
