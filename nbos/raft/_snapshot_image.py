"""The image in the driver's Raft snapshots: the application's, the client sessions and the
member addresses.

A member that starts from a snapshot (after a restart, or too far behind for the log)
skipped the entries it covers, so the image carries all they built: the application's
state, and the driver's own tables, without which that member would apply a retry
twice or not reach the members that the skipped entries added.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from nbos.core.replicated_log import StateMachine
from nbos.core.wire.log_commands import DriverSnapshot, MemberAddress
from nbos.raft._client_sessions import ClientSessions

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DriverSnapshot)


class SnapshotImage:
    """Makes the image of what the log applied, and restores one."""

    def __init__(self, state_machine: StateMachine, sessions: ClientSessions) -> None:
        self._sm = state_machine
        self._sessions = sessions

    def encode(self, members: Iterable[MemberAddress]) -> bytes:
        return _encoder.encode(
            DriverSnapshot(
                app=self._sm.snapshot(),
                sessions=self._sessions.sessions(),
                members=list(members),
            )
        )

    def restore(self, image: bytes) -> list[MemberAddress]:
        """Restore the application and the sessions; returns the member addresses, for
        the driver to reach them. An empty image (no snapshot yet) restores nothing."""
        if not image:
            return []
        snapshot = _decoder.decode(image)
        self._sm.restore(snapshot.app)
        self._sessions.restore(snapshot.sessions)
        return snapshot.members
