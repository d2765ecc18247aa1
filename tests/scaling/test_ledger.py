"""The one ledger: its sums over time, a window's totals, and the cells' grants."""

from __future__ import annotations

import pytest

from nbos.core.ids import KernelId
from nbos.scaling.ledger import HostCount, Ledger, Totals

K = KernelId("k")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hosts_and_committed_gpus_are_summed_over_the_time_they_held() -> None:
    clock = Clock()
    ledger = Ledger(clock, hosts=2, gpus=16)
    clock.now = 10.0
    ledger.gpus_committed(4)
    clock.now = 30.0
    ledger.hosts_changed(3, 24)
    ledger.gpus_committed(0)
    clock.now = 40.0
    totals = ledger.totals()
    assert (totals.host_s, totals.provisioned_gpu_s) == (2 * 30 + 3 * 10, 16 * 30 + 24 * 10)
    assert totals.committed_gpu_s == 4 * 20
    assert ledger.peak_committed == 4
    assert ledger.hosts() == [HostCount(0.0, 2, 16), HostCount(30.0, 3, 24)]


def test_an_unchanged_host_count_is_not_recorded_again() -> None:
    ledger = Ledger(Clock(), hosts=1, gpus=8)
    ledger.hosts_changed(1, 8)
    assert len(ledger.hosts()) == 1


def test_a_window_is_the_difference_of_two_totals_and_replay_scales_its_times() -> None:
    clock = Clock()
    ledger = Ledger(clock, hosts=1, gpus=8)
    ledger.migrations = 2
    before = ledger.totals()
    clock.now = 5.0
    ledger.migrations += 1
    ledger.ceiling_s += 2.0
    window = ledger.totals() - before
    assert window == Totals(migrations=1, ceiling_s=2.0, host_s=5.0, provisioned_gpu_s=40.0)
    assert window.scaled(60) == Totals(
        migrations=1, ceiling_s=120.0, host_s=300.0, provisioned_gpu_s=2400.0
    )


def test_a_cells_grant_commits_its_gpus_once_from_start_to_end() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    ledger.cell_ready(K, 1, 2)
    clock.now = 1.0
    ledger.cell_started(K, 1)
    ledger.cell_ready(K, 1, 2)  # asked again after a migration: still the same cell
    clock.now = 3.0
    ledger.cell_started(K, 1)
    clock.now = 4.0
    ledger.cell_ended(K, 1)
    ledger.cell_ended(K, 1)
    clock.now = 9.0
    (cell,) = ledger.cells()
    assert (cell.ready, cell.started, cell.ended) == (0.0, 1.0, 4.0)
    assert ledger.totals().committed_gpu_s == pytest.approx(2 * 3.0)
    assert ledger.peak_committed == 2


def test_a_cell_that_never_started_commits_nothing() -> None:
    ledger = Ledger(Clock())
    ledger.cell_ready(K, 1, 4)
    ledger.cell_ended(K, 1)
    ledger.cell_started(K, 2)  # never ready: not the ledger's
    assert ledger.peak_committed == 0 and ledger.cells()[0].started is None
