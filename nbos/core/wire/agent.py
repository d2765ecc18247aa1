"""Gateway <-> host agent messages: GPU reservations on one host.

Requests go from the gateway's scheduler to a host agent and carry a
``request_id``; the agent answers each with exactly one reply carrying the same
id (:class:`GpuGranted`, :class:`GpuRefused`, :class:`GpuFreed` or
:class:`AgentStatus`). The transport may lose or duplicate messages, so the
scheduler retries and every request is idempotent on the agent.

The agent also sends :class:`AgentStatus` unprompted (``request_id=None``): when it
starts and at every heartbeat. A new ``incarnation`` tells the gateway that the
agent restarted; it then sends :class:`AgentRestore` with the committed
reservations the agent lost.
"""

from __future__ import annotations

from typing import Literal

from nbos.core.wire.base import Message

ReservationStateName = Literal["precommitted", "committed", "released", "expired"]
RefusalReason = Literal["insufficient", "unknown", "expired", "invalid", "evict_failed"]


class GpuReservation(Message):
    """One reservation as the agent's pool holds it; ``evict_from`` is ``(device, kernel)``."""

    reservation_id: str
    kernel_id: str
    devices: list[int]
    state: ReservationStateName
    evict_from: list[tuple[int, str]] = []


# --- requests (gateway -> agent) -------------------------------------------------


class GpuPrecommit(Message):
    """Reserve ``n`` devices for an expected executor of ``kernel_id``."""

    request_id: int
    reservation_id: str
    kernel_id: str
    n: int


class GpuCommit(Message):
    """Bind a reservation to a running cell (taken fresh if the agent lost it)."""

    request_id: int
    reservation_id: str
    kernel_id: str
    n: int


class GpuRelease(Message):
    """Free a reservation; ``resident`` leaves the kernel's tensors on the devices (lazily)."""

    request_id: int
    reservation_id: str
    resident: bool = False


class GpuReleaseKernel(Message):
    """Free every reservation and resident mark of a kernel on this host."""

    request_id: int
    kernel_id: str


class GpuEvicted(Message):
    """The kernel's replica on this host moved its resident tensors off every device."""

    request_id: int
    kernel_id: str


class AgentStatusRequest(Message):
    """Ask for an :class:`AgentStatus` now."""

    request_id: int


class AgentRestore(Message):
    """After an agent restart: committed reservations the gateway knows the agent held."""

    request_id: int
    reservations: list[GpuReservation]


# --- replies and reports (agent -> gateway) --------------------------------------


class GpuGranted(Message):
    """The reservation as the pool holds it after the request."""

    request_id: int
    reservation: GpuReservation


class GpuRefused(Message):
    """A request the agent could not carry out; ``idle`` is its idle device count now."""

    request_id: int
    reason: RefusalReason
    message: str
    idle: int = 0


class GpuFreed(Message):
    """Answer to release, release-kernel, evicted and restore: reservations freed, devices freed."""

    request_id: int
    reservation_ids: list[str] = []
    devices: list[int] = []


class AgentStatus(Message):
    """The agent's whole pool: on start, every heartbeat, and in answer to a status request.

    ``reservations`` are the live ones (pre-committed and committed); ``resident``
    lists idle devices still holding a kernel's tensors as ``(device, kernel)``.
    """

    host_id: str
    incarnation: str
    address: str
    devices: list[int]
    reservations: list[GpuReservation] = []
    resident: list[tuple[int, str]] = []
    request_id: int | None = None


AgentRequest = (
    GpuPrecommit
    | GpuCommit
    | GpuRelease
    | GpuReleaseKernel
    | GpuEvicted
    | AgentStatusRequest
    | AgentRestore
)
AgentReply = GpuGranted | GpuRefused | GpuFreed | AgentStatus
AgentMessage = AgentRequest | AgentReply | GpuReservation
