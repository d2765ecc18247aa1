"""The chaos report: one line per fault, and the violations found after it."""

from __future__ import annotations

import attrs

from nbos.chaos._checks import Violation

_COLUMNS = ("#", "fault", "target", "detected", "recovered", "lost", "violations")


@attrs.frozen
class FaultReport:
    """One fault: whether the kernel noticed it (``detected``: the victims left the
    front's live set or a cell did not end ok), seconds from the strike to the next
    ok cell (``recovered_s``, ``None`` if none came), cells reported lost in its window,
    and the violations first found after it."""

    number: int
    nemesis: str
    target: str
    detected: bool
    recovered_s: float | None
    cells_lost: int
    violations: tuple[Violation, ...]


@attrs.frozen
class ChaosReport:
    """A whole run: its seed, its faults, and how many workload cells ended ok."""

    seed: int
    faults: tuple[FaultReport, ...]
    cells: int
    cells_ok: int

    @property
    def violations(self) -> tuple[Violation, ...]:
        return tuple(v for f in self.faults for v in f.violations)

    @property
    def ok(self) -> bool:
        """No violation: every promise held under every fault."""
        return not self.violations

    def table(self) -> str:
        """The report as a plain-text table, the violations listed under it."""
        rows = [_COLUMNS, *(_row(f) for f in self.faults)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines += [f"fault {f.number}: {v}" for f in self.faults for v in f.violations]
        lines.append(
            f"seed {self.seed}: {len(self.faults)} faults, {self.cells_ok}/{self.cells} cells "
            f"ok, {sum(f.cells_lost for f in self.faults)} lost, "
            f"{len(self.violations)} violations"
        )
        return "\n".join(lines)


def _row(fault: FaultReport) -> tuple[str, ...]:
    recovered = "never" if fault.recovered_s is None else f"{fault.recovered_s:.1f} s"
    return (
        str(fault.number),
        fault.nemesis,
        fault.target,
        "y" if fault.detected else "n",
        recovered,
        str(fault.cells_lost),
        str(len(fault.violations)),
    )
