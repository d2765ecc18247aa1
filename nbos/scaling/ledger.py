"""What one cluster did: the accounting the gateway's scheduler and the simulator both keep.

Each keeps one :class:`Ledger` on its own clock (wall-clock seconds in the gateway, so
that ``nbos replay`` in another process can relate them to its own; simulated seconds
in the simulator) and writes to it as things happen: the moves and scaling actions,
the time the autoscaler sat at its host ceiling while work waited, the host count and
the GPUs committed. The ledger sums hosts, GPUs provisioned and GPUs committed over
time, so that a run's figures, or a window's (the difference of two :class:`Totals`),
are read off it and not re-derived; :mod:`nbos.scaling.results` turns them into the
table both ``nbos simulate`` and ``nbos replay`` print.

The gateway also records every cell's grant (``nbos replay`` matches them against its
trace for the cells' delays); the simulator knows those directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from nbos.core.ids import KernelId
from nbos.scaling.delays import DelaySplit, split_wait


class CellUsage(msgspec.Struct, forbid_unknown_fields=True):
    """One cell's GPUs as the scheduler granted them.

    ``arrived``: its ``execute_request`` reached the kernel's front (``None``: not known);
    ``ready``: the front asked for its executor (the previous cell had settled);
    ``started``: its GPUs were committed (``None``: it never got them); ``ended``: they
    were released (``None``: still running, or a cell of no GPUs). Between ``ready`` and
    ``started`` it waited ``gpus_s`` for GPUs, ``scale_out_s`` for hosts being added and
    ``migration_s`` for a replica to move (:mod:`nbos.scaling.delays`).
    """

    kernel_id: str
    exec_index: int
    gpus: int
    ready: float
    started: float | None = None
    ended: float | None = None
    arrived: float | None = None
    gpus_s: float = 0.0
    scale_out_s: float = 0.0
    migration_s: float = 0.0

    def split(self) -> DelaySplit | None:
        """Where the cell's delay from its arrival to its start went (``None``: not started);
        ``overhead`` is what the waits leave of the time from ``ready`` to ``started``."""
        if self.started is None:
            return None
        arrived = self.ready if self.arrived is None else min(self.arrived, self.ready)
        waits = self.gpus_s + self.scale_out_s + self.migration_s
        return DelaySplit(
            queue=self.ready - arrived,
            gpus=self.gpus_s,
            migration=self.migration_s,
            scale_out=self.scale_out_s,
            overhead=max(0.0, self.started - self.ready - waits),
        )


class HostCount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """From ``time`` on, the cluster had ``hosts`` hosts with ``gpus`` GPUs in all."""

    time: float
    hosts: int
    gpus: int


class Totals(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ledger's counts and running sums (``*_s``: seconds of its clock) at one moment."""

    migrations: int = 0
    drain_moves: int = 0
    scale_outs: int = 0
    scale_ins: int = 0
    #: Time the autoscaler spent at its host ceiling while work waited.
    ceiling_s: float = 0.0
    host_s: float = 0.0
    provisioned_gpu_s: float = 0.0
    committed_gpu_s: float = 0.0

    def __sub__(self, earlier: Totals) -> Totals:
        """What happened between ``earlier`` and these totals."""
        now, then = msgspec.structs.astuple(self), msgspec.structs.astuple(earlier)
        return Totals(*(a - b for a, b in zip(now, then, strict=True)))

    def scaled(self, k: float) -> Totals:
        """The same totals with their times ``k`` times longer (replay's trace time)."""
        return msgspec.structs.replace(
            self,
            ceiling_s=self.ceiling_s * k,
            host_s=self.host_s * k,
            provisioned_gpu_s=self.provisioned_gpu_s * k,
            committed_gpu_s=self.committed_gpu_s * k,
        )


class Ledger:
    """What the cluster did, kept in memory for its life.

    The counters (``migrations``, ``drain_moves``, ``scale_outs``, ``scale_ins``,
    ``ceiling_s``) are added to by whoever acts; the host count and GPUs committed
    are told through :meth:`hosts_changed` and :meth:`gpus_committed` (or, in the
    gateway, the cells' grants).
    """

    def __init__(
        self, clock: Callable[[], float] = time.time, hosts: int = 0, gpus: int = 0
    ) -> None:
        self._clock = clock
        self.since = clock()
        self.migrations = 0
        self.drain_moves = 0
        self.scale_outs = 0
        self.scale_ins = 0
        self.ceiling_s = 0.0
        self.peak_committed = 0
        self._committed = 0
        self._cells: dict[tuple[KernelId, int], CellUsage] = {}
        self._hosts: list[HostCount] = [HostCount(self.since, hosts, gpus)]
        self._host_s = self._provisioned_gpu_s = self._committed_gpu_s = 0.0
        self._summed_to = self.since

    def now(self) -> float:
        return self._clock()

    # --- the cluster's size and load ------------------------------------------------------

    def hosts_changed(self, hosts: int, gpus: int) -> None:
        last = self._hosts[-1]
        if (last.hosts, last.gpus) != (hosts, gpus):
            self._sum()
            self._hosts.append(HostCount(self._summed_to, hosts, gpus))

    def gpus_committed(self, total: int) -> None:
        """The cluster has ``total`` GPUs committed from now on."""
        self._sum()
        self._committed = total
        self.peak_committed = max(self.peak_committed, total)

    def _sum(self) -> None:
        """Add the time since the last change, at the levels that held during it."""
        now = self._clock()
        elapsed = now - self._summed_to
        if elapsed > 0:
            last = self._hosts[-1]
            self._host_s += last.hosts * elapsed
            self._provisioned_gpu_s += last.gpus * elapsed
            self._committed_gpu_s += self._committed * elapsed
            self._summed_to = now

    # --- cells' grants (the gateway) ----------------------------------------------------

    def cell_ready(
        self, kernel_id: KernelId, exec_index: int, gpus: int, arrived: float | None = None
    ) -> None:
        key = (kernel_id, exec_index)
        if key not in self._cells:  # a cell that migrated asks again: it was ready before
            self._cells[key] = CellUsage(
                kernel_id, exec_index, gpus, self._clock(), arrived=arrived
            )

    def cell_waited(
        self, kernel_id: KernelId, exec_index: int, waited: float, scale_out: float
    ) -> None:
        """The cell waited ``waited`` seconds for GPUs, ``scale_out`` of them while hosts
        were being added (:func:`~nbos.scaling.delays.split_wait`)."""
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None:
            gpus, scaling = split_wait(waited, scale_out)
            cell.gpus_s += gpus
            cell.scale_out_s += scaling

    def cell_migrated(self, kernel_id: KernelId, exec_index: int, seconds: float) -> None:
        """The cell waited ``seconds`` for a replica to move to a host with its GPUs."""
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None:
            cell.migration_s += max(0.0, seconds)

    def cell_retried(self, kernel_id: KernelId, lost: int, exec_index: int) -> None:
        """The cell of index ``lost`` goes again as ``exec_index`` (its executor's claim
        lost; nothing ran): one cell, whose record moves to the new index with when it
        was ready and what it waited, to start anew there."""
        cell = self._cells.pop((kernel_id, lost), None)
        if cell is not None:
            self._cells[(kernel_id, exec_index)] = msgspec.structs.replace(
                cell, exec_index=exec_index, started=None, ended=None
            )

    def cell_started(self, kernel_id: KernelId, exec_index: int) -> None:
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None and cell.started is None:
            cell.started = self._clock()
            self.gpus_committed(self._committed + cell.gpus)

    def cell_ended(self, kernel_id: KernelId, exec_index: int) -> None:
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None and cell.started is not None and cell.ended is None:
            cell.ended = self._clock()
            self.gpus_committed(self._committed - cell.gpus)

    # --- reading it -------------------------------------------------------------------

    def totals(self) -> Totals:
        self._sum()
        return Totals(
            self.migrations,
            self.drain_moves,
            self.scale_outs,
            self.scale_ins,
            self.ceiling_s,
            self._host_s,
            self._provisioned_gpu_s,
            self._committed_gpu_s,
        )

    def cells(self) -> list[CellUsage]:
        return list(self._cells.values())

    def cell(self, kernel_id: KernelId, exec_index: int) -> CellUsage | None:
        """The grant of one cell (``None``: it never asked for its executor)."""
        return self._cells.get((kernel_id, exec_index))

    def hosts(self) -> list[HostCount]:
        """The host count at the start and at each change."""
        return list(self._hosts)
