"""The ``ReplicatedLog`` interface and the ``StateMachine`` it drives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from nbos.core.ids import NodeId, PeerId


@runtime_checkable
class StateMachine(Protocol):
    """What an application gives a replicated log: deterministic apply, plus snapshots.

    ``apply`` is called once per committed entry, in log order, on every replica;
    it must be deterministic (same entries, same state) and must not raise for
    bad application input: it returns an error value instead, since a raise would
    stop the replica from applying anything after it. ``snapshot`` returns a byte
    image of the state as of the last applied entry; ``restore`` replaces the state
    with such an image.
    """

    def apply(self, index: int, data: bytes) -> bytes:
        """Apply one committed entry; the result is handed back to its proposer."""
        ...

    def snapshot(self) -> bytes:
        """An image of the state after the last applied entry."""
        ...

    def restore(self, image: bytes) -> None:
        """Replace the whole state with ``image``."""
        ...


@runtime_checkable
class ReplicatedLog(Protocol):
    """A log replicated over a group of nodes by consensus, driving a :class:`StateMachine`.

    * ``propose`` returns once the entry is committed **and** applied on this node,
      with ``apply``'s result. It raises
      :class:`~nbos.core.errors.NotLeaderError` (with a leader hint) when this node
      cannot accept proposals, :class:`~nbos.core.errors.ProposalTimeoutError`
      when the deadline passes, and :class:`~nbos.core.errors.LogClosedError` after
      shutdown. When ``client_id`` and ``seq`` are given, a retried proposal with the
      same pair applies at most once and the retry gets the first result.
    * Cancelling ``propose`` does not withdraw the entry: it may still commit.
    * ``read_index`` returns an index such that, once this node has applied it,
      reading local state is linearizable.
    * Membership: a node is added as a non-voting learner, promoted to voter once it
      has caught up, and removed. One change at a time; a refused change raises
      :class:`~nbos.core.errors.MembershipChangeError`.
    """

    @property
    def node_id(self) -> NodeId:
        """This node's id."""
        ...

    @property
    def leader_id(self) -> NodeId | None:
        """The leader this node currently knows of."""
        ...

    @property
    def applied_index(self) -> int:
        """Index of the last entry applied to the state machine."""
        ...

    async def propose(
        self,
        data: bytes,
        *,
        client_id: str | None = None,
        seq: int | None = None,
        timeout: float = 10.0,
    ) -> bytes:
        """Replicate ``data``; returns the state machine's result for it."""
        ...

    async def read_index(self, *, timeout: float = 10.0) -> int:
        """Confirm leadership and return the commit index as of now."""
        ...

    async def wait_applied(self, index: int) -> None:
        """Wait until ``applied_index >= index``."""
        ...

    async def add_learner(self, node: NodeId, peer: PeerId, address: str) -> None:
        """Add a non-voting member, reached as transport peer ``peer`` at ``address``."""
        ...

    async def promote(self, node: NodeId) -> None:
        """Make a caught-up learner a voter."""
        ...

    async def remove(self, node: NodeId) -> None:
        """Remove a member (voter or learner)."""
        ...

    async def transfer_leadership(self, node: NodeId) -> None:
        """Hand leadership to ``node``."""
        ...

    def voters(self) -> Sequence[NodeId]:
        """The current voting members."""
        ...

    async def aclose(self) -> None:
        """Stop the node; pending proposals fail with ``LogClosedError``."""
        ...
