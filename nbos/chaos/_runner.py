"""The chaos run: the workload under a seeded schedule of faults, checked after each."""

from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc

from nbos.chaos._checks import (
    Violation,
    check_digests,
    check_effects,
    check_execution_counts,
    check_outcomes,
    check_runs,
)
from nbos.chaos._control_plane import CpuHog, FreezeAgent, FreezeGateway
from nbos.chaos._control_requests import MalformedRequests, StartFlood
from nbos.chaos._deployment_faults import KillAgent, KillGateway, PartitionHost
from nbos.chaos._freeze import FreezeReplica
from nbos.chaos._full_disk import FillDisk
from nbos.chaos._healthy import Bystander, listed
from nbos.chaos._kills import KillExecutor, KillFollower, KillTwo
from nbos.chaos._nemesis import Nemesis, Strike, until
from nbos.chaos._report import ChaosReport, FaultReport
from nbos.chaos._schedule import PlannedFault, plan_faults
from nbos.chaos._target import EMBEDDED, Capability, ChaosKernel, EmbeddedKernel
from nbos.chaos._workload import CellRecord, Workload
from nbos.cluster import Kernel
from nbos.core.errors import ConfigError, KernelError, NemesisUnsupportedError

log = logging.getLogger(__name__)

#: How long the slow cell goes on after the planned strike, so the fault lands in it.
_SLOW_TAIL_S = 2.0
#: Between cells that failed while the kernel recovers: not a busy loop.
_RETRY_S = 0.25


class Observer(Protocol):
    """Told of each fault as it strikes and once it has been checked (progress output)."""

    def fault_started(self, fault: PlannedFault, strike: Strike) -> None: ...

    def fault_done(self, report: FaultReport) -> None: ...


def default_nemeses() -> tuple[Nemesis, ...]:
    """Every nemesis of replica processes, with its default settings."""
    return (
        KillExecutor(),
        KillExecutor(mid_cell=False),
        KillFollower(),
        FreezeReplica("executor"),
        FreezeReplica("follower"),
        KillTwo(),
    )


def known_nemeses() -> tuple[Nemesis, ...]:
    """:func:`default_nemeses` and those of a gateway deployment and its control plane,
    with nothing to carry them out yet (see :mod:`nbos.chaos._deployment_faults`,
    :mod:`nbos.chaos._control_plane`)."""
    return (
        *default_nemeses(),
        PartitionHost(),
        KillGateway(),
        KillAgent(),
        FreezeGateway(),
        FreezeAgent(),
        CpuHog(),
        FillDisk(),
        StartFlood(),
        MalformedRequests(),
    )


def check_supported(
    nemeses: Sequence[Nemesis],
    offered: frozenset[Capability] = EMBEDDED,
    cluster: str = "embedded cluster",
) -> None:
    """Raise :class:`NemesisUnsupportedError` for the first nemesis ``cluster`` cannot run."""
    names = [n.name for n in nemeses]
    if not nemeses or len(set(names)) != len(names):
        raise ConfigError("nemeses", names, "at least one nemesis, each name once")
    for nemesis in nemeses:
        missing = sorted(nemesis.needs - offered)
        if missing:
            raise NemesisUnsupportedError(nemesis.name, missing, cluster)


async def run_chaos(
    kernel: Kernel | ChaosKernel,
    *,
    seed: int = 0,
    duration_s: float = 60.0,
    nemeses: Sequence[Nemesis] | None = None,
    max_faults: int | None = None,
    recovery_s: float = 60.0,
    cell_timeout_s: float = 45.0,
    observer: Observer | None = None,
    run_dir: Path | None = None,
    bystanders: Sequence[Kernel | ChaosKernel] = (),
) -> ChaosReport:
    """Run the workload on ``kernel`` under faults: a kernel of the embedded cluster, or
    any :class:`ChaosKernel` (:class:`GatewayKernel`: one of a gateway by address).

    Faults follow the schedule of ``seed`` over ``nemeses`` (default: all of
    :func:`default_nemeses`); no fault starts after ``duration_s`` seconds or past
    ``max_faults``. After each, the kernel has ``recovery_s`` seconds to serve a cell
    and to get back to as many live replicas as it started with (the run ends at the
    first fault it did not recover from); a cell, and each replica's digest, gets
    ``cell_timeout_s`` seconds to answer. The report lists every violation found.
    ``run_dir``: where the replicas record which cells ran, a directory they can write at
    that path (default: a new one on this machine, right for hosts on this machine).
    ``bystanders``: other kernels of the same cluster, which no fault may kill or rob of
    their state; after every fault each must still be listed, run a cell and hold every
    append it acknowledged (``no-healthy-kernel-dead``).
    """
    target = _chaos_kernel(kernel)
    chosen = tuple(nemeses) if nemeses is not None else default_nemeses()
    check_supported(chosen, target.offers, target.where)
    for key, value in (
        ("duration_s", duration_s),
        ("recovery_s", recovery_s),
        ("cell_timeout_s", cell_timeout_s),
        ("max_faults", 1 if max_faults is None else max_faults),
    ):
        if not value > 0:
            raise ConfigError(key, value, "a positive number")
    with tempfile.TemporaryDirectory(prefix="nbos-chaos-", dir=run_dir) as tmp:
        workload = Workload(target, Path(tmp) / "ran", cell_timeout_s=cell_timeout_s)
        await workload.setup()
        others = [Bystander(_chaos_kernel(k)) for k in bystanders]
        for other in others:
            await other.setup(cell_timeout_s)
        nemesis_by_name = {n.name: n for n in chosen}
        run = _Run(
            target,
            len((await target.view()).alive),
            workload,
            nemesis_by_name,
            others,
            recovery_s=recovery_s,
            cell_timeout_s=cell_timeout_s,
        )
        faults: list[FaultReport] = []
        end = anyio.current_time() + duration_s
        for planned in plan_faults(seed, [n.name for n in chosen]):
            over = max_faults is not None and planned.number > max_faults
            if over or anyio.current_time() >= end:
                break
            report = await run.fault(planned, observer)
            log.info("chaos fault %d: %s", report.number, report)
            faults.append(report)
            if observer is not None:
                observer.fault_done(report)
            if report.recovered_s is None:
                log.warning("chaos: the kernel did not recover from fault %d", report.number)
                break
    history = workload.history
    return ChaosReport(seed, tuple(faults), len(history), sum(r.outcome == "ok" for r in history))


class _Run:
    """One run's state: the kernel, the workload, and the violations reported so far."""

    def __init__(
        self,
        kernel: ChaosKernel,
        strength: int,
        workload: Workload,
        nemeses: dict[str, Nemesis],
        bystanders: list[Bystander],
        *,
        recovery_s: float,
        cell_timeout_s: float,
    ) -> None:
        self._kernel = kernel
        self._workload = workload
        self._nemeses = nemeses
        self._bystanders = bystanders
        self._recovery_s = recovery_s
        self._cell_timeout_s = cell_timeout_s
        self._strength = strength
        self._seen: set[Violation] = set()

    async def fault(self, planned: PlannedFault, observer: Observer | None) -> FaultReport:
        """Run fault ``planned`` from its first workload cell to its checks."""
        for _ in range(planned.cells_before):
            await self._workload.cell(planned.number)
        first = len(self._workload.history)
        strike, struck_at, noticed = await self._inject(planned, observer)
        if strike is not None and strike.replies_lost:
            self._workload.unanswered_as_indeterminate(first)
        recovered = await self._recovered(planned.number, first, struck_at)
        found, checked, whole = await self._check(recovered)
        if strike is not None:
            found += strike.found
            checked += strike.checked
        new = [v for v in found if v not in self._seen]
        self._seen.update(new)
        window = self._workload.history[first - planned.cells_before :]
        lost = sum(r.outcome == "lost" for r in window)
        failed = sum(r.outcome != "ok" for r in window)
        return FaultReport(
            number=planned.number,
            nemesis=planned.nemesis,
            target=strike.target if strike is not None else "not struck",
            detected=noticed or failed > 0,
            recovered_s=recovered if whole else None,
            cells_lost=lost,
            violations=tuple(new),
            checked=tuple(dict.fromkeys(checked)),
            struck=strike is not None,
        )

    async def _inject(
        self, planned: PlannedFault, observer: Observer | None
    ) -> tuple[Strike | None, float, bool]:
        """Strike mid-cell, keep the fault in force, heal it.

        The strike, its wall-clock time, and whether the kernel noticed it.
        """
        nemesis = self._nemeses[planned.nemesis]
        noticed = anyio.Event()
        healed = anyio.Event()
        async with anyio.create_task_group() as watching:
            strike, struck_at = await self._strike_mid_cell(
                planned, nemesis, watching, noticed, healed
            )
            if strike is not None:
                try:
                    if observer is not None:
                        observer.fault_started(planned, strike)
                    # One more cell while the fault is in force: the kernel must serve it or
                    # say the quorum is lost, never leave it hanging.
                    await self._workload.cell(planned.number)
                    await healed.wait()
                except BaseException:  # a fault is never left in force (a stopped gateway)
                    if not healed.is_set():
                        with anyio.CancelScope(shield=True):
                            await nemesis.heal(self._kernel, strike)
                    raise
            watching.cancel_scope.cancel()
        if strike is None:
            return None, struck_at, False
        return strike, struck_at, noticed.is_set() or strike.noticed

    async def _heal_when_due(
        self, nemesis: Nemesis, strike: Strike, struck_at: float, healed: anyio.Event
    ) -> None:
        """Heal ``strike`` once it lasted its time, whether or not its cells ended: a
        frozen executor's cell waits for it (suspicion is not proof) until it thaws."""
        await anyio.sleep(max(0.0, struck_at + strike.lasts_s - time.time()))
        with anyio.CancelScope(shield=True):
            await nemesis.heal(self._kernel, strike)
        healed.set()

    async def _check(self, recovered: float | None) -> tuple[list[Violation], list[str], bool]:
        """Every check on the history and, if it serves cells, on the kernel; and on the
        other kernels. The violations, the invariants checked, and whether the kernel
        under test is there to go on with (listed and serving cells)."""
        found = check_outcomes(self._workload.history)
        found += check_execution_counts(self._workload.execution_counts)
        checked = ["defined-outcome", "recovers", "no-healthy-kernel-dead"]
        gone = await listed(self._kernel)
        if gone:
            found += gone
        elif recovered is None:
            # The kernel serves no cell: reading its state would only time out as well.
            found.append(Violation("no-recovery", f"no cell ok {self._recovery_s} s after"))
        else:
            found += await self._full_strength()
            found += await self._kernel_checks()
            checked += ["exactly-once", "replicas-agree"]
        for other in self._bystanders:
            found += await other.probe(cell_timeout=self._cell_timeout_s, within=self._recovery_s)
        return found, checked, not gone and recovered is not None

    async def _strike_mid_cell(
        self,
        planned: PlannedFault,
        nemesis: Nemesis,
        watching: anyio.abc.TaskGroup,
        noticed: anyio.Event,
        healed: anyio.Event,
    ) -> tuple[Strike | None, float]:
        """Start a slow cell, strike ``strike_after_s`` into it; return once the cell ended.

        The strike (``None`` if there was nothing to strike) and its wall-clock time.
        """
        slow_done = anyio.Event()
        strike: Strike | None = None

        async def slow() -> None:
            try:
                sleep_s = planned.strike_after_s + _SLOW_TAIL_S
                await self._workload.cell(planned.number, sleep_s=sleep_s)
            finally:
                slow_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)

            async def running() -> bool:
                return slow_done.is_set() or (await self._kernel.view()).running_on is not None

            await until(running)
            await anyio.sleep(planned.strike_after_s)
            struck_at = time.time()
            try:
                strike = await nemesis.strike(self._kernel, random.Random(planned.seed))
            except KernelError as exc:  # nothing to strike: the kernel was not whole
                log.warning("chaos fault %d not struck: %s", planned.number, exc)
            else:
                watching.start_soon(self._watch, strike.victims, noticed)
                watching.start_soon(self._heal_when_due, nemesis, strike, struck_at, healed)
        return strike, struck_at

    async def _watch(self, victims: tuple[int, ...], noticed: anyio.Event) -> None:
        """Set ``noticed`` once the front stopped counting every victim as alive (a fault
        of no replica, such as the gateway's, is noticed by the cells it fails)."""
        if not victims:
            return

        async def gone() -> bool:
            return not set(victims) & set((await self._kernel.view()).alive)

        await until(gone)
        noticed.set()

    async def _recovered(self, fault: int, first: int, struck_at: float) -> float | None:
        """Seconds from the strike to the first ok cell after it; cells sent until one is."""
        deadline = anyio.current_time() + self._recovery_s
        while True:
            ok = _first_ok(self._workload.history[first:], struck_at)
            if ok is not None:
                return ok.replied_at - struck_at
            if anyio.current_time() >= deadline:
                return None
            if self._workload.history[first:]:
                await anyio.sleep(_RETRY_S)
            await self._workload.cell(fault)

    async def _full_strength(self) -> list[Violation]:
        async def whole() -> bool:
            return len((await self._kernel.view()).alive) >= self._strength

        with anyio.move_on_after(self._recovery_s):
            await until(whole)
            return []
        alive = (await self._kernel.view()).alive
        return [
            Violation(
                "degraded",
                f"replicas {list(alive)} alive, {self._strength} wanted, "
                f"{self._recovery_s} s after healing",
            )
        ]

    async def _kernel_checks(self) -> list[Violation]:
        """Read the kernel's state and its replicas' digests, and check them."""
        workload = self._workload
        found: list[Violation] = []
        observed = await workload.observe()
        if isinstance(observed, str):
            found.append(Violation("unreadable", observed))
        else:
            found += check_effects(workload.history, observed)
            found += check_runs(workload.history, observed.ran)
        view = await self._kernel.view()
        after = view.last_exec_index
        digests = await self._kernel.digests(after=after, timeout=self._cell_timeout_s)
        found += check_digests(digests, view.alive, after)
        return found


def _chaos_kernel(kernel: Kernel | ChaosKernel) -> ChaosKernel:
    return EmbeddedKernel(kernel) if isinstance(kernel, Kernel) else kernel


def _first_ok(records: Sequence[CellRecord], after: float) -> CellRecord | None:
    return next((r for r in records if r.outcome == "ok" and r.replied_at >= after), None)
