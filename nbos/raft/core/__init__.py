"""The sans-IO Raft core: a pure state machine in the manner of etcd-io/raft.

No asyncio, clock, socket or file inside: a driver feeds it and carries out
what it asks. The driver contract::

    node = RaftNode(node_id, storage_view, RaftConfig(...), random.Random(seed))
    loop:
        on a timer tick:        node.tick()
        on a peer message:      node.step(msg)
        on a client request:    node.propose(data) -> index      (NotLeaderError if not leader)
                                node.propose_conf_change(ConfChange(...)) -> index
                                node.read_index(ctx)             (answer: a ReadState)
                                node.transfer_leadership(to)
        after a local snapshot: node.compact(index, image)       (image already durable)
        rd = node.ready()
        if rd is not None:
            persist rd.snapshot, rd.entries, rd.hard_state (durably, in that order)
            send rd.messages                          # only after persisting: they may
                                                      # promise what was just persisted
            restore rd.snapshot into the state machine, apply rd.committed_entries,
            hand rd.read_states to readers once applied
            node.advance(rd)

No input may be given between ``ready()`` and ``advance()`` (the driver queues
it). A node restarts from a :class:`StorageView` of what it persisted; a new
group starts from :func:`bootstrap`. Membership changes take effect when their
entry is applied (on ``advance``); a leader that applied its own removal is
``leaving`` (refuses proposals and reads) until a quorum of the new voters knows
the change committed. Deduplication of retried proposals belongs to the layer
above. Status for the driver: ``node.id``, ``role``, ``term``, ``leader_id``,
``commit_index``, ``applied_index``, ``conf``, ``snapshot``, ``leaving``.
``nbos.raft.core.sim`` is a deterministic in-memory group for tests. See
``docs/raft.md``.
"""

from nbos.raft.core.confchange import apply_change, bootstrap, decode_change, encode_change
from nbos.raft.core.config import RaftConfig, StorageView
from nbos.raft.core.log import RaftLog
from nbos.raft.core.node import RaftNode, Role
from nbos.raft.core.progress import Progress, ProgressState
from nbos.raft.core.ready import ReadState, Ready, Snapshot

__all__ = [
    "Progress",
    "ProgressState",
    "RaftConfig",
    "RaftLog",
    "RaftNode",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "StorageView",
    "apply_change",
    "bootstrap",
    "decode_change",
    "encode_change",
]
