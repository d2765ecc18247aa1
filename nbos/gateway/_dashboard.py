"""What the gateway's dashboard shows (``docs/deploy.md``, *Dashboard*), read from the gateway.

* :class:`EventLog`: the event log, a bounded ring fed by the process's events sink
  (:func:`nbos.metrics.events`: every place that reports a replacement, a migration, a
  host suspected, back, joined or gone, a scale-out or scale-in, a refused request), and
  the cell waits of the last minute;
* :class:`Dashboard`: the cluster now (:meth:`Dashboard.board`: hosts and their GPUs, kernels
  and their replicas), its figures sampled every :data:`SAMPLE_S` seconds into a bounded
  ring (:meth:`Dashboard.run`), and each of them as one user may see it
  (:meth:`Dashboard.view`): their own kernels (an admin: all), GPUs named to their kernels
  only, events of their kernels and of hosts (an admin: all, refused requests too).

Everything is read on the event loop that changes it, so a board is one moment's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import msgspec

from nbos.core.identity import User
from nbos.core.ids import HostId, KernelId
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import KernelManager, StartUnderWay
from nbos.gateway.control_api import HostStatus
from nbos.metrics import ClusterEvent
from nbos.scaling.ledger import Ledger

#: How often the figures of the time series are sampled.
SAMPLE_S = 5.0
#: How far back the time series goes.
HISTORY_S = 6 * 3600.0
#: Events kept; older ones are dropped first.
EVENTS_MAX = 1000
#: Cell waits are percentiles over the cells that got their GPUs within this window.
WAIT_WINDOW_S = 60.0
#: The most cell waits kept for that window (a flood of cells keeps the latest).
_WAITS_MAX = 50_000


class Sample(msgspec.Struct, frozen=True):
    """The cluster's figures at one moment (``t``: wall-clock seconds): hosts up, GPUs of
    the hosts up (provisioned), GPUs pre-committed or committed to cells (committed),
    GPUs of running cells (busy), cells waiting for GPUs, and the waits of the cells that
    got their GPUs within the last :data:`WAIT_WINDOW_S` (``None``: no cell did)."""

    t: float
    hosts: int
    gpus_provisioned: int
    gpus_committed: int
    gpus_busy: int
    cells_waiting: int
    wait_p50: float | None
    wait_p95: float | None
    wait_p99: float | None


@attrs.frozen
class Logged:
    """An event of the log, numbered in order (``seq``), and the user of its kernel."""

    seq: int
    event: ClusterEvent
    owner: str


class EventLog:
    """The events sink of the gateway's dashboard (install it with
    :func:`nbos.metrics.installed`, with Prometheus's through a
    :class:`~nbos.metrics.Fanout`): the last :data:`EVENTS_MAX` events and recent cell waits."""

    def __init__(self, maxlen: int = EVENTS_MAX) -> None:
        self._events: deque[tuple[int, ClusterEvent]] = deque(maxlen=maxlen)
        self._seq = 0
        self._waits: deque[tuple[float, float]] = deque(maxlen=_WAITS_MAX)

    def cell_waited(self, seconds: float) -> None:
        self._waits.append((time.time(), seconds))

    def cell_ran(self, seconds: float) -> None:
        pass

    def cell_delayed(self, cause: str, seconds: float) -> None:
        pass

    def message_refused(self) -> None:
        pass

    def happened(self, event: ClusterEvent) -> None:
        self._seq += 1
        self._events.append((self._seq, event))

    @property
    def last_seq(self) -> int:
        """The number of the latest event (0 before the first)."""
        return self._seq

    def since(self, seq: int) -> list[tuple[int, ClusterEvent]]:
        """The events numbered after ``seq`` that are still kept, oldest first."""
        if seq >= self._seq:
            return []
        return [(n, e) for n, e in self._events if n > seq]

    def waits(self, since: float) -> list[float]:
        """The waits of the cells that got their GPUs at or after ``since``."""
        while self._waits and self._waits[0][0] < since - WAIT_WINDOW_S:
            self._waits.popleft()
        return [w for t, w in self._waits if t >= since]


def percentile(values: Sequence[float], share: float) -> float | None:
    """The ``share`` quantile of ``values`` (nearest rank); ``None`` for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1))
    return ordered[rank]


class Dashboard:
    """The dashboard's figures over one gateway; run :meth:`run` in a task for the series.

    ``host_status`` is the gateway's account of its hosts (the one ``nbos status`` shows);
    ``api_ids`` maps each nbos kernel id the Kernel Gateway API serves to the id the API
    shows (the same until the API restarts the kernel).
    """

    def __init__(
        self,
        kernel_manager: KernelManager,
        host_status: Callable[[], Sequence[HostStatus]],
        event_log: EventLog,
        api_ids: Callable[[], Mapping[str, str]],
        *,
        history: int = round(HISTORY_S / SAMPLE_S),
    ) -> None:
        self.kernel_manager = kernel_manager
        self.events = event_log
        self._host_status = host_status
        self._api_ids = api_ids
        self.samples: deque[Sample] = deque(maxlen=history)
        self._board: dict[str, Any] | None = None
        self._board_at = -1.0
        #: Hosts that left, with when: shown as ``gone`` for an hour.
        self._gone: dict[str, float] = {}
        self._known: set[str] = set()

    async def run(self, period: float = SAMPLE_S) -> None:
        """Sample the figures every ``period`` seconds, forever."""
        while True:
            self.sample()
            await anyio.sleep(period)

    def sample(self) -> Sample:
        """Take one sample of the figures into the series."""
        now = time.time()
        hosts = [h for h in self._host_status() if h.state != "suspected"]
        waits = self.events.waits(now - WAIT_WINDOW_S)
        sample = Sample(
            t=now,
            hosts=len(hosts),
            gpus_provisioned=sum(h.gpus for h in hosts),
            gpus_committed=sum(h.precommitted + h.committed for h in hosts),
            gpus_busy=sum(h.committed for h in hosts),
            cells_waiting=len(self.kernel_manager.scheduler.waiting()),
            wait_p50=percentile(waits, 0.50),
            wait_p95=percentile(waits, 0.95),
            wait_p99=percentile(waits, 0.99),
        )
        self.samples.append(sample)
        return sample

    def samples_since(self, t: float) -> list[Sample]:
        return [s for s in self.samples if s.t > t]

    # --- the cluster now ------------------------------------------------------------

    def board(self, max_age: float = 0.5) -> dict[str, Any]:
        """The cluster now, every kernel and GPU holder named (:meth:`view` filters it);
        one board serves every client asking within ``max_age`` seconds."""
        now = time.monotonic()
        if self._board is None or now - self._board_at > max_age:
            self._board, self._board_at = self._read(), now
        return self._board

    def _read(self) -> dict[str, Any]:
        now = time.time()
        ids = self._api_ids()
        owners = self.kernel_manager.owners
        hosts = [self._host(h, ids, owners) for h in self._host_status()]
        self._note_gone({h["id"] for h in hosts}, now)
        hosts += [_gone_host(h) for h in sorted(self._gone)]
        ledger = self.kernel_manager.scheduler.ledger
        waiting = {k for k, _ in self.kernel_manager.scheduler.waiting()}
        kernels = [
            _kernel(k, ids.get(k.kernel_id, k.kernel_id), ledger, now, k.kernel_id in waiting)
            for k in self.kernel_manager.kernels
        ]
        kernels += [
            _starting(s, ids.get(s.kernel_id, s.kernel_id), now) for s in self.kernel_manager.starts
        ]
        return {"time": now, "hosts": hosts, "kernels": kernels}

    def _note_gone(self, present: set[str], now: float) -> None:
        for host in self._known - present:
            self._gone[host] = now
        for host in present:
            self._gone.pop(host, None)
        self._known = present
        for host, left in list(self._gone.items()):
            if now - left > 3600.0:
                del self._gone[host]

    def _host(
        self, status: HostStatus, ids: Mapping[str, str], owners: Mapping[KernelId, str]
    ) -> dict[str, Any]:
        scheduler = self.kernel_manager.scheduler
        model = scheduler.model
        host_id = HostId(status.host_id)
        state: str = status.state
        if state == "up" and model.is_draining(host_id):
            state = "draining"
        gpus: list[dict[str, Any]] = [
            {"device": d, "state": "idle", "kernel": "", "user": ""} for d in range(status.gpus)
        ]
        subscribed = replicas = 0
        try:
            record = scheduler.host(host_id)
        except KeyError:  # registered, no GPU report yet
            pass
        else:
            gpus = _devices(record.devices, record.reported.values(), record.resident, ids, owners)
            view = model.host(host_id)
            subscribed, replicas = view.gpus_subscribed, view.replicas
        return {
            "id": status.host_id,
            "address": status.address,
            "state": state,
            "gpus": gpus,
            "subscribed": subscribed,
            "ratio": subscribed / status.gpus if status.gpus else None,
            "replicas": replicas,
        }

    # --- one user's view ------------------------------------------------------------

    def view(self, user: User) -> dict[str, Any]:
        """The board as ``user`` may see it."""
        board = self.board()
        owners = self.kernel_manager.owners
        return {
            "time": board["time"],
            "hosts": [_host_for(h, user) for h in board["hosts"]],
            "kernels": [k for k in board["kernels"] if user.may_see(k["user"])],
            "waiting": sum(
                user.may_see(owners.get(k, "")) for k, _ in self.kernel_manager.scheduler.waiting()
            ),
        }

    def events_for(self, user: User, after: int) -> list[dict[str, Any]]:
        """The events after number ``after`` that ``user`` may see, oldest first."""
        owners = self.kernel_manager.owners
        ids = self._api_ids()
        shown = []
        for seq, event in self.events.since(after):
            if event.kind == "refused" and not user.is_admin:
                continue
            if event.kernel and not user.may_see(owners.get(KernelId(event.kernel), "")):
                continue
            shown.append(_event(seq, event, ids))
        return shown


def _devices(
    devices: Iterable[int],
    reservations: Iterable[Any],
    resident: Iterable[tuple[int, str]],
    ids: Mapping[str, str],
    owners: Mapping[KernelId, str],
) -> list[dict[str, Any]]:
    """Each device of a host: its state and the kernel (and user) it is for."""
    held: dict[int, tuple[str, str]] = {}
    for reservation in reservations:
        for device in reservation.devices:
            held[device] = (reservation.state, reservation.kernel_id)
    kept = dict(resident)
    out = []
    for device in devices:
        state, kernel = held.get(device, ("idle", ""))
        if state == "idle" and device in kept:
            state, kernel = "resident", kept[device]
        out.append(
            {
                "device": device,
                "state": state,
                "kernel": ids.get(kernel, kernel),
                "user": owners.get(KernelId(kernel), "") if kernel else "",
            }
        )
    return out


def _gone_host(host_id: str) -> dict[str, Any]:
    return {
        "id": host_id,
        "address": "",
        "state": "gone",
        "gpus": [],
        "subscribed": 0,
        "ratio": None,
        "replicas": 0,
    }


def _host_for(host: dict[str, Any], user: User) -> dict[str, Any]:
    """``host`` with the GPUs of kernels ``user`` may not see shown by state alone."""
    gpus = [
        g if not g["kernel"] or user.may_see(g["user"]) else {**g, "kernel": "", "user": ""}
        for g in host["gpus"]
    ]
    return {**host, "gpus": gpus}


def _kernel(
    kernel: Kernel, api_id: str, ledger: Ledger, now: float, waiting: bool
) -> dict[str, Any]:
    front = kernel.front
    voters = set(front.voters)
    executor = front.running_on if front.running_on is not None else front.last_executor
    replicas = [
        {
            "node": r.node,
            "host": r.host,
            "alive": r.alive,
            "role": "executor"
            if r.node == executor
            else "follower"
            if r.node in voters
            else "learner",
        }
        for r in kernel.replicas
    ]
    joining = kernel.joining
    if joining is not None and joining[0] not in {r["node"] for r in replicas}:
        replicas.append({"node": joining[0], "host": joining[1], "alive": True, "role": "learner"})
    return {
        "id": api_id,
        "nbos_id": kernel.kernel_id,
        "user": kernel.owner,
        "state": kernel.state,
        "gpus": kernel.gpus,
        "age_s": max(0.0, now - kernel.started_at),
        "replicas": replicas,
        "last_cell": _last_cell(kernel, ledger, now, waiting),
        "waiting": None,
    }


def _starting(start: StartUnderWay, api_id: str, now: float) -> dict[str, Any]:
    """A start under way as a kernel of the board: ``starting``, no replicas yet, and why it
    waits while it waits for a host."""
    return {
        "id": api_id,
        "nbos_id": start.kernel_id,
        "user": start.owner,
        "state": "starting",
        "gpus": start.gpus,
        "age_s": max(0.0, now - start.asked_at),
        "replicas": [],
        "last_cell": None,
        "waiting": start.waiting,
    }


def _last_cell(kernel: Kernel, ledger: Ledger, now: float, waiting: bool) -> dict[str, Any] | None:
    """The kernel's latest cell: its number, and how long it waited (or waits) for its
    executor and GPUs (``None``: it has not asked yet)."""
    index = kernel.front.last_exec_index
    if index == 0:
        return None
    usage = ledger.cell(kernel.kernel_id, index)
    if usage is None:
        return {"index": index, "gpus": None, "wait_s": None, "waiting": waiting}
    end = usage.started if usage.started is not None else now
    return {
        "index": index,
        "gpus": usage.gpus,
        "wait_s": max(0.0, end - usage.ready),
        "waiting": usage.started is None,
    }


def _event(seq: int, event: ClusterEvent, ids: Mapping[str, str]) -> dict[str, Any]:
    """An event for the page: the kernel named by the id the API shows."""
    shown = ids.get(event.kernel, event.kernel) if event.kernel else ""
    text = event.text.replace(event.kernel, shown) if shown != event.kernel else event.text
    return {
        "seq": seq,
        "time": event.time,
        "kind": event.kind,
        "text": text,
        "kernel": shown,
        "host": event.host,
    }
