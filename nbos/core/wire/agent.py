"""Gateway <-> host agent messages."""

from __future__ import annotations

from nbos.core.wire.base import Message


class AgentHello(Message):
    """Placeholder until the host agent defines its messages."""

    host_id: str


AgentMessage = AgentHello
