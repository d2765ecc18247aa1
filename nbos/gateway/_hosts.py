"""What the scheduler knows of the hosts: what each agent last reported, plus its own grants."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.wire.agent import AgentStatus, GpuReservation
from nbos.scaling import ClusterModel

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

    ``suspected`` turns true when its agent does not answer a request or stops
    reporting (:mod:`nbos.gateway._host_liveness`); such a host is left out of executor
    choice and placement until it reports again.
    """

    host_id: HostId
    peer: PeerId
    address: str
    incarnation: str
    devices: tuple[int, ...]
    reported: dict[str, GpuReservation] = attrs.Factory(dict)
    #: Idle devices still holding a kernel's tensors, as ``(device, kernel)``.
    resident: tuple[tuple[int, str], ...] = ()
    suspected: bool = False
    #: The host's available memory as its agent last reported it (``None``: not said).
    memory_available_mib: int | None = None

    def update(self, peer: PeerId, status: AgentStatus) -> bool:
        """Take a status report; ``True`` if it comes from a new agent incarnation."""
        restarted = status.incarnation != self.incarnation
        self.peer, self.address, self.incarnation = peer, status.address, status.incarnation
        self.devices = tuple(status.devices)
        self.reported = {r.reservation_id: r for r in status.reservations if r.state in _LIVE}
        self.resident = tuple(status.resident)
        self.memory_available_mib = status.memory_available_mib
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


class Hosts:
    """The hosts the scheduler knows and its grants on them, mirrored into the cluster model.

    Every change to a host's report or to the grants there goes through here, so that
    the model's committed GPUs of a host are always the devices either holds.
    """

    def __init__(self, model: ClusterModel) -> None:
        self.model = model
        self._records: dict[HostId, HostRecord] = {}
        # Grants by reservation id, and the same by host: a host's count looks at its own.
        self._grants: dict[str, Grant] = {}
        self._on: dict[HostId, dict[str, Grant]] = {}
        #: Reservation ids whose cells started (committed on their agents).
        self.committed: set[str] = set()

    # --- hosts -------------------------------------------------------------------------

    def get(self, host_id: HostId) -> HostRecord | None:
        return self._records.get(host_id)

    def __getitem__(self, host_id: HostId) -> HostRecord:
        return self._records[host_id]

    def __contains__(self, host_id: object) -> bool:
        return host_id in self._records

    def records(self) -> Iterable[HostRecord]:
        return self._records.values()

    def live(self, host_id: HostId) -> bool:
        """Whether the host reported and is not suspected."""
        host = self._records.get(host_id)
        return host is not None and not host.suspected

    def join(self, host: HostRecord) -> None:
        self._records[host.host_id] = host
        self.model.add_host(host.host_id, len(host.devices))
        self.synced(host.host_id)

    def leave(self, host_id: HostId) -> bool:
        """Forget the host (``False`` if unknown); what names it in the model stays aside."""
        if self._records.pop(host_id, None) is None:
            return False
        self.model.remove_host(host_id)
        return True

    def set_suspected(self, host: HostRecord, suspected: bool) -> None:
        host.suspected = suspected
        # A request still in flight when its host left (or rejoined, with a new record)
        # holds the old record: what it learns is about a host the model no longer has.
        if self._records.get(host.host_id) is host:
            self.model.set_suspected(host.host_id, suspected)

    def synced(self, host_id: HostId) -> None:
        """The host's report changed (or what it holds was freed): the model follows."""
        host = self._records.get(host_id)
        if host is not None:
            busy = len(host.busy(self.on(host_id).values()))
            self.model.set_gpus(host_id, len(host.devices), busy)
            self.model.set_free_memory(host_id, host.memory_available_mib)

    # --- grants ------------------------------------------------------------------------

    def grant(self, res: str) -> Grant | None:
        return self._grants.get(res)

    def grants(self) -> tuple[Grant, ...]:
        """Live grants (pre-committed or committed), oldest first."""
        return tuple(self._grants.values())

    def on(self, host_id: HostId) -> Mapping[str, Grant]:
        """The grants on ``host_id``, by reservation id."""
        return self._on.get(host_id, {})

    def keep(self, grant: Grant) -> None:
        self._grants[grant.reservation_id] = grant
        self._on.setdefault(grant.host, {})[grant.reservation_id] = grant
        self.synced(grant.host)

    def drop(self, res: str) -> Grant | None:
        """Forget the grant; ``None`` if there was none."""
        grant = self._grants.pop(res, None)
        if grant is not None:
            on_host = self._on[grant.host]
            del on_host[res]
            if not on_host:
                del self._on[grant.host]
            self.synced(grant.host)
        return grant
