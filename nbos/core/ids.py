"""Identifiers shared by every layer.

They are plain strings and ints at run time (cheap on the wire, easy to log);
the ``NewType`` wrappers keep a host id from being passed where a kernel id is due.
"""

from __future__ import annotations

import uuid
from typing import NewType

KernelId = NewType("KernelId", str)
HostId = NewType("HostId", str)
#: Address of a transport endpoint, e.g. ``"host-1/agent"`` or ``"k-3f2a/raft/2"``.
PeerId = NewType("PeerId", str)
#: A Raft node id: unique within one replicated log (one kernel's replicas), never reused.
NodeId = NewType("NodeId", int)
#: Content address of a blob: ``"sha256:" + hex digest``.
BlobKey = NewType("BlobKey", str)

BLOB_KEY_PREFIX = "sha256:"


def new_kernel_id() -> KernelId:
    """A fresh random kernel id."""
    return KernelId(str(uuid.uuid4()))
