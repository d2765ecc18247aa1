"""The gateway's accounting: every cell's GPU grant and the cluster's size over time.

The scheduler writes it as it grants and releases GPUs and as hosts join and leave;
the autoscaler's loop adds its actions and drain moves, the kernels' choosers their
migrations. ``nbos replay`` reads it (control request ``UsageRequest``) and turns it
into the metrics ``nbos simulate`` prints. Times are wall-clock seconds, so that a
client in another process can relate them to its own.
"""

from __future__ import annotations

import time

from nbos.core.ids import KernelId
from nbos.gateway.control_api import CellUsage, HostCount, Usage


class Ledger:
    """What the cluster did; kept in memory for the gateway's life."""

    def __init__(self) -> None:
        self.since = time.time()
        self._cells: dict[tuple[KernelId, int], CellUsage] = {}
        self._hosts: list[HostCount] = [HostCount(self.since, 0, 0)]
        self.migrations = 0
        self.drain_moves = 0
        self.scale_outs = 0
        self.scale_ins = 0
        self.ceiling_s = 0.0

    def cell_ready(self, kernel_id: KernelId, exec_index: int, gpus: int) -> None:
        key = (kernel_id, exec_index)
        if key not in self._cells:  # a cell that migrated asks again: it was ready before
            self._cells[key] = CellUsage(kernel_id, exec_index, gpus, time.time())

    def cell_started(self, kernel_id: KernelId, exec_index: int) -> None:
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None and cell.started is None:
            cell.started = time.time()

    def cell_ended(self, kernel_id: KernelId, exec_index: int) -> None:
        cell = self._cells.get((kernel_id, exec_index))
        if cell is not None and cell.started is not None and cell.ended is None:
            cell.ended = time.time()

    def hosts_changed(self, hosts: int, gpus: int) -> None:
        last = self._hosts[-1]
        if (last.hosts, last.gpus) != (hosts, gpus):
            self._hosts.append(HostCount(time.time(), hosts, gpus))

    def usage(self) -> Usage:
        return Usage(
            self.since,
            time.time(),
            list(self._cells.values()),
            list(self._hosts),
            self.migrations,
            self.drain_moves,
            self.scale_outs,
            self.scale_ins,
            self.ceiling_s,
        )
