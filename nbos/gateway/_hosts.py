"""The scheduler's model of the hosts: what each agent last reported, plus its own grants."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.wire.agent import AgentStatus, GpuReservation

_LIVE = ("precommitted", "committed")


@attrs.frozen
class Grant:
    """GPUs pre-committed for one cell: run it on ``replica`` (on ``host``) with ``devices``.

    A cell asking for no GPUs gets a grant with no devices and an empty
    ``reservation_id``; committing and releasing it are no-ops.
    """

    kernel_id: KernelId
    exec_index: int
    replica: int
    host: HostId
    devices: tuple[int, ...]
    reservation_id: str


@attrs.define
class HostRecord:
    """One host as the scheduler knows it.

    ``reachable`` turns false when its agent does not answer a request or stops
    reporting; such a host is left out of executor choice and placement until it
    reports again.
    """

    host_id: HostId
    peer: PeerId
    address: str
    incarnation: str
    devices: tuple[int, ...]
    last_seen: float
    reported: dict[str, GpuReservation] = attrs.Factory(dict)
    #: Idle devices still holding a kernel's tensors, as ``(device, kernel)``.
    resident: tuple[tuple[int, str], ...] = ()
    reachable: bool = True

    def update(self, peer: PeerId, status: AgentStatus, now: float) -> bool:
        """Take a status report; ``True`` if it comes from a new agent incarnation."""
        restarted = status.incarnation != self.incarnation
        self.peer, self.address, self.incarnation = peer, status.address, status.incarnation
        self.devices = tuple(status.devices)
        self.reported = {r.reservation_id: r for r in status.reservations if r.state in _LIVE}
        self.resident = tuple(status.resident)
        self.last_seen = now
        self.reachable = True
        return restarted

    def busy(self, own: Iterable[Grant]) -> set[int]:
        """Devices held by the agent's live reservations or by this scheduler's grants here.

        Both count: a report may predate a fresh pre-commit, and a grant may have
        expired on the agent without the scheduler knowing yet. Erring towards busy
        only delays a cell; the agent refuses anything it cannot honour.
        """
        held = {d for r in self.reported.values() for d in r.devices}
        held.update(d for g in own if g.host == self.host_id for d in g.devices)
        return held & set(self.devices)

    def by_state(self) -> dict[str, int]:
        """Devices by state as the agent last reported: idle, precommitted, committed,
        resident (idle but holding tensors)."""
        held = {d: r.state for r in self.reported.values() for d in r.devices}
        counts = {s: sum(v == s for v in held.values()) for s in _LIVE}
        resident = {d for d, _ in self.resident} - set(held)
        return {
            "idle": len(self.devices) - len(held),
            **counts,
            "resident": len(resident),
        }
