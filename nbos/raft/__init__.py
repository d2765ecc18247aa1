"""The in-tree Raft: a sans-IO core, durable storage, and the anyio driver.

:func:`open_raft_log` runs one node and yields a
:class:`~nbos.core.replicated_log.ReplicatedLog`.
"""

from nbos.raft._waiters import Outcome
from nbos.raft.driver import RaftReplicatedLog, open_raft_log

__all__ = ["Outcome", "RaftReplicatedLog", "open_raft_log"]
