"""What a kernel's front and its replicas say to each other beyond the Jupyter protocol.

The front and the replica both import this module, and it imports neither side: the
front (which runs in the gateway) must not load ipykernel, IPython or Raft, and the
replica must not load the front. It holds:

* the ``execute_request`` metadata keys the front sets (:func:`cell_metadata`) and the
  replica reads (:func:`cell_request`);
* the ``interrupt_request`` metadata naming the cell it interrupts
  (:func:`interrupt_metadata`, :func:`interrupted_cell`);
* the replica's reply metadata under :data:`REPLY_INFO_KEY`, in which a replica whose
  claim lost names the winner (:func:`claim_lost_info`, :func:`claim_lost`), and under
  :data:`IOPUB_COUNT_KEY` (:func:`take_published_count`);
* the front's own control requests (the ``nbos_*_request`` message types), their
  replies' types (:func:`reply_of`) and the content fields the front reads back;
* :func:`error_content`, the content of every error reply either side makes;
* :data:`CLAIM_FRESH_S`, a timing both sides rely on;
* :data:`RAFT_STATE_GONE_STATUS`, how a replica restarted in place says that its disk
  lost its Raft state (the gateway, which starts it, reads its exit status).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbos.core.errors import KernelError

#: ``execute_request`` metadata: the cell's index in the kernel's log (a positive int).
EXEC_INDEX_KEY = "nbos_exec_index"
#: ``execute_request`` metadata: the host-local GPU device ids the cell runs with.
DEVICES_KEY = "nbos_devices"
#: ``interrupt_request`` metadata: the msg_id of the ``execute_request`` it interrupts
#: (a replica keeps it for that cell if the cell has not reached it yet).
INTERRUPTED_CELL_KEY = "nbos_cell"
#: ``execute_reply`` metadata: what the replica says about the cell (its index, timings,
#: or the winner of the claim that beat it).
REPLY_INFO_KEY = "nbos"
#: In :data:`REPLY_INFO_KEY` of an ``aborted`` reply: the replica whose claim won.
CLAIM_LOST_TO = "claim_lost_to"
#: Metadata of every reply a replica sends: how many IOPub messages other than
#: ``status`` it published for the request before the reply (the front's idle goes out
#: once it relayed them; it removes the key).
IOPUB_COUNT_KEY = "nbos_iopub"

#: How long after its ``Done`` committed an executor's claim of the next cell stands
#: without a read barrier (the claim rides in the ``Done``). For that cell to have been
#: declared lost meanwhile, the front must have had the ``Done``'s reply, sent the cell,
#: and then given the executor up (a ping timed out: the front refuses ping timeouts
#: shorter than :data:`MIN_PING_TIMEOUT_S`) or restarted; neither fits in this window.
CLAIM_FRESH_S = 0.05
#: The exit status of a replica started with ``--recover`` whose Raft state is gone from
#: its data dir (or damaged): it cannot come back from that disk.
RAFT_STATE_GONE_STATUS = 3
#: The shortest ping timeout a front accepts: ten times :data:`CLAIM_FRESH_S`.
MIN_PING_TIMEOUT_S = 10 * CLAIM_FRESH_S

#: Commit ``Done(exec_index, lost)`` for a cell whose executor died (or that was never
#: run under that index); the reply says how the cell ended (:data:`CELL_STATUS`).
LOST_REQUEST = "nbos_lost_request"
#: The namespace digest once cell ``after`` has applied (tests, replacement checks).
DIGEST_REQUEST = "nbos_digest_request"
#: The last committed ``Done`` (:data:`LAST_DONE`) and who claimed the cell after it
#: (:data:`NEXT_CLAIMED_BY`): what a front that takes a kernel over goes on from.
PROGRESS_REQUEST = "nbos_progress_request"
#: Move tensors left on GPUs to host memory (the host needs the ``devices``).
EVICT_REQUEST = "nbos_evict_request"
#: A Raft membership change, for replacing a dead replica.
MEMBER_REQUEST = "nbos_member_request"
#: The process of replica :data:`GONE_NODE` ended (proof, never suspicion): if it led the
#: kernel's Raft group, campaign at once; the reply says whether it did (:data:`CAMPAIGNED`).
LEADER_GONE_REQUEST = "nbos_leader_gone_request"

#: Content fields: of :data:`LOST_REQUEST` (the cell to settle), of
#: :data:`DIGEST_REQUEST` (the cell to wait for), of :data:`EVICT_REQUEST` and of
#: :data:`LEADER_GONE_REQUEST` (the replica whose process ended).
LOST_INDEX = "exec_index"
DIGEST_AFTER = "after"
EVICT_DEVICES = "devices"
GONE_NODE = "node"
#: Content fields of the replies the front reads.
CELL_STATUS = "cell_status"
EXECUTION_COUNT = "execution_count"
LAST_DONE = "last_done"
NEXT_CLAIMED_BY = "next_claimed_by"
CAMPAIGNED = "campaigned"


def reply_of(request_type: str) -> str:
    """The message type of the reply to one of the control requests above."""
    return request_type.removesuffix("_request") + "_reply"


def cell_metadata(
    metadata: Mapping[str, Any], exec_index: int, devices: tuple[int, ...]
) -> dict[str, Any]:
    """A client's ``execute_request`` metadata with the front's keys for one replica."""
    return {**metadata, EXEC_INDEX_KEY: exec_index, DEVICES_KEY: list(devices)}


def cell_request(metadata: Any) -> tuple[int, tuple[int, ...]]:
    """The exec index and device ids of a front's request; ``KernelError`` if absent or bad."""
    if not isinstance(metadata, dict):
        raise KernelError("execute_request without metadata")
    index, devices = metadata.get(EXEC_INDEX_KEY), metadata.get(DEVICES_KEY, [])
    if not isinstance(index, int) or isinstance(index, bool) or index < 1:
        raise KernelError(f"execute_request needs a positive int {EXEC_INDEX_KEY}, got {index!r}")
    if not isinstance(devices, list) or not all(isinstance(d, int) for d in devices):
        raise KernelError(f"{DEVICES_KEY} must be a list of ints, got {devices!r}")
    return index, tuple(devices)


def interrupt_metadata(metadata: Mapping[str, Any], cell: str) -> dict[str, Any]:
    """A client's ``interrupt_request`` metadata naming the ``cell`` it interrupts."""
    return {**metadata, INTERRUPTED_CELL_KEY: cell}


def interrupted_cell(metadata: Any) -> str | None:
    """The cell an ``interrupt_request`` names, or ``None`` (a client's own, not the front's)."""
    cell = metadata.get(INTERRUPTED_CELL_KEY) if isinstance(metadata, dict) else None
    return cell if isinstance(cell, str) else None


def claim_lost_info(winner: int) -> dict[str, Any]:
    """The :data:`REPLY_INFO_KEY` of a replica whose claim lost to ``winner``."""
    return {CLAIM_LOST_TO: winner}


def claim_lost(reply_metadata: Mapping[str, Any]) -> bool:
    """Whether an ``execute_reply`` says the replica's claim lost (it ran nothing)."""
    info = reply_metadata.get(REPLY_INFO_KEY)
    return isinstance(info, dict) and CLAIM_LOST_TO in info


def take_published_count(reply_metadata: dict[str, Any]) -> int | None:
    """Remove :data:`IOPUB_COUNT_KEY` from a reply's metadata and return it: how many
    IOPub messages the replica published for the request before the reply (``None``:
    the reply does not say)."""
    count = reply_metadata.pop(IOPUB_COUNT_KEY, None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def error_content(exc: BaseException, execution_count: int) -> dict[str, Any]:
    """The content of an error reply for ``exc`` (``ename`` is its class name)."""
    name = type(exc).__name__
    return {
        "status": "error",
        "ename": name,
        "evalue": str(exc),
        "traceback": [f"{name}: {exc}"],
        "execution_count": execution_count,
    }
