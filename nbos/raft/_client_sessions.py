"""Client sessions: each client's last applied proposal and its result.

A proposal carries a session ``(client_id, seq)``. A copy that reaches the log again
(a client's retry, a follower's hand-over to a new leader) applies once: the state
machine sees the first copy, and the later ones get its result. Every member applies
the same entries, so all keep the same sessions, and the Raft snapshot carries them.
"""

from __future__ import annotations

import logging

from nbos.core.replicated_log import StateMachine
from nbos.core.wire.log_commands import ClientSession, Proposal

log = logging.getLogger(__name__)


class ClientSessions:
    """Applies proposals to the state machine once per ``(client_id, seq)``, keeping
    each client's last one and its result."""

    def __init__(self, node_id: int, state_machine: StateMachine) -> None:
        self._node_id = node_id
        self._sm = state_machine
        self._last: dict[str, ClientSession] = {}

    def result(self, client_id: str, seq: int) -> bytes | None:
        """What ``(client_id, seq)`` returned if it applied already, else ``None``.

        One older than the client's last gets ``b""``: a session keeps the last only.
        """
        session = self._last.get(client_id)
        if session is None or seq > session.seq:
            return None
        return session.result if seq == session.seq else b""

    def last_result(self, client_id: str, seq: int) -> bytes | None:
        """The result of ``(client_id, seq)`` if it is the client's last applied proposal."""
        session = self._last.get(client_id)
        if session is None or session.seq != seq:
            return None
        return session.result

    def apply(self, index: int, proposal: Proposal) -> ClientSession | None:
        """Apply the proposal of entry ``index`` and return its new session; ``None``
        if it applied already (:meth:`result` has what it returned)."""
        session = self._last.get(proposal.client_id)
        if session is not None and proposal.seq <= session.seq:
            return None
        try:
            result = self._sm.apply(index, proposal.data)
        except Exception:
            # The StateMachine contract forbids raising; every replica hits the same
            # entry, so skipping it keeps them equal rather than stopping all of them.
            log.exception("node %d: state machine raised on entry %d", self._node_id, index)
            result = b""
        session = self._last[proposal.client_id] = ClientSession(
            proposal.client_id, proposal.seq, result
        )
        return session

    def sessions(self) -> list[ClientSession]:
        return list(self._last.values())

    def restore(self, sessions: list[ClientSession]) -> None:
        self._last = {s.client_id: s for s in sessions}
