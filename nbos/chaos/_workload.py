"""The workload: cells whose effects can be counted, and the client's record of each.

Every workload cell ``seq`` does ``n += 1`` and ``L.append(seq)``, sets a name of its
own (``cell_<seq>``, never written again: a replica that missed the cell differs by it
whatever came later), optionally sleeps (so that a fault can land while it runs), then
appends ``"seq time"`` to a file on this machine: the file says which cells ran and
when, whatever the kernel reported.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Literal

import attrs

from nbos.chaos._target import ChaosKernel
from nbos.cluster import ExecuteResult
from nbos.core.errors import KernelError

log = logging.getLogger(__name__)

#: ok: acknowledged, its effect must be there once; lost: the kernel said it did not
#: happen (its effect must never be there); indeterminate: the kernel said its outcome is
#: not known yet (applied at most once); unknown: any other answer, or none.
Outcome = Literal["ok", "lost", "indeterminate", "unknown"]

#: The errors by which the kernel says a cell did not happen (a dead kernel refuses a cell
#: before it goes anywhere).
LOST_ERRORS = frozenset({"CellLostError", "KernelDeadError"})
#: The errors by which the kernel says a cell has no outcome yet: a cell in flight when the
#: majority went is settled once a majority is back, and its executor's ``Done`` may have
#: committed first (``docs/kernel.md``, Recovery).
INDETERMINATE_ERRORS = frozenset({"QuorumLostError"})

_SETUP = "import json\nimport time\nn = 0\nL = []"
_READ = "print(json.dumps({'n': n, 'L': L}))"


@attrs.frozen
class CellRecord:
    """One workload cell as the client saw it.

    ``fault`` is the number of the fault whose window the cell was sent in (0 before
    the first); ``ename`` the error's name when it did not end ok (``TimeoutError``
    when no answer came); ``replied_at`` the wall-clock time of the answer.
    """

    seq: int
    fault: int
    outcome: Outcome
    ename: str | None
    execution_count: int | None
    executor: int | None
    replied_at: float


@attrs.frozen
class Observed:
    """What the kernel's namespace and the run file hold after a fault."""

    n: int
    appended: tuple[int, ...]
    #: seq -> the wall-clock times at which that cell finished running, per the file.
    ran: dict[int, tuple[float, ...]]


class Workload:
    """Sends workload cells to ``kernel`` and records what came back.

    ``run_file`` must be writable by the kernel's replica processes, at that path (the
    embedded cluster runs them on this machine; other hosts need it on a shared file
    system).
    """

    def __init__(self, kernel: ChaosKernel, run_file: Path, *, cell_timeout_s: float) -> None:
        self._kernel = kernel
        self._run_file = run_file
        self._timeout = cell_timeout_s
        self._next_seq = 1
        self.history: list[CellRecord] = []
        #: ``execution_count`` of every ok reply, in order (reads included).
        self.execution_counts: list[int] = []

    async def setup(self) -> None:
        """Define ``n`` and ``L``; raises :class:`KernelError` if that cell fails."""
        self._run_file.touch()
        result = await self._kernel.execute(_SETUP, timeout=self._timeout)
        if result.status != "ok":
            raise KernelError(f"the chaos workload could not start: {result.error}")
        self._count(result)

    async def cell(self, fault: int, *, sleep_s: float = 0.0) -> CellRecord:
        """Run the next workload cell; its record (also appended to :attr:`history`)."""
        seq = self._next_seq
        self._next_seq += 1
        code = (
            f"n += 1\nL.append({seq})\ncell_{seq} = {seq}\ntime.sleep({sleep_s!r})\n"
            f"open({str(self._run_file)!r}, 'a').write(f'{seq} {{time.time()!r}}\\n')"
        )
        try:
            result = await self._kernel.execute(code, timeout=self._timeout)
        except TimeoutError:
            record = CellRecord(seq, fault, "unknown", "TimeoutError", None, None, time.time())
        else:
            record = self._record(seq, fault, result)
        log.debug("chaos cell %d: %s %s", seq, record.outcome, record.ename or "")
        self.history.append(record)
        return record

    def unanswered_as_indeterminate(self, first: int) -> None:
        """Count the cells from ``first`` on that got no answer as of no known outcome
        (their replies died with the process that held them)."""
        self.history[first:] = [
            attrs.evolve(r, outcome="indeterminate") if r.ename == "TimeoutError" else r
            for r in self.history[first:]
        ]

    async def observe(self) -> Observed | str:
        """Read ``n`` and ``L`` from the kernel and the run file; a reason if the read failed."""
        try:
            result = await self._kernel.execute(_READ, timeout=self._timeout)
        except TimeoutError:
            return "the read cell got no answer"
        if result.status != "ok":
            return f"the read cell failed: {result.error}"
        self._count(result)
        state = json.loads(result.stdout)
        return Observed(int(state["n"]), tuple(state["L"]), self._ran())

    def _ran(self) -> dict[int, tuple[float, ...]]:
        ran: defaultdict[int, list[float]] = defaultdict(list)
        for line in self._run_file.read_text().splitlines():
            seq, at = line.split()
            ran[int(seq)].append(float(at))
        return {seq: tuple(times) for seq, times in ran.items()}

    def _record(self, seq: int, fault: int, result: ExecuteResult) -> CellRecord:
        self._count(result)
        outcome: Outcome
        if result.status == "ok":
            outcome, ename = "ok", None
        else:
            ename = result.error[0] if result.error else result.status
            outcome = _outcome(ename)
        return CellRecord(
            seq, fault, outcome, ename, result.execution_count, result.executor, time.time()
        )

    def _count(self, result: ExecuteResult) -> None:
        if result.status == "ok" and result.execution_count is not None:
            self.execution_counts.append(result.execution_count)


def _outcome(ename: str) -> Outcome:
    if ename in LOST_ERRORS:
        return "lost"
    return "indeterminate" if ename in INDETERMINATE_ERRORS else "unknown"
