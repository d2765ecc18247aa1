"""The chaos report: one line per fault, and the violations found after it."""

from __future__ import annotations

import json
from typing import Any

import attrs

from nbos.chaos._checks import INVARIANTS, Violation, invariant_of

_COLUMNS = ("#", "fault", "target", "detected", "recovered", "lost", "violations")
_NEMESIS_COLUMNS = ("nemesis", "injected", "violations", "invariants checked")


@attrs.frozen
class FaultReport:
    """One fault: whether the kernel noticed it (``detected``: the victims left the
    front's live set or a cell did not end ok), seconds from the strike to the next
    ok cell (``recovered_s``, ``None`` if none came or the kernel is gone), cells reported
    lost in its window,
    and the violations first found after it; ``checked``: the invariants checked
    after it (:data:`~nbos.chaos.INVARIANTS` names); ``struck``: the fault was injected
    (``False``: there was nothing to strike, the kernel was not whole)."""

    number: int
    nemesis: str
    target: str
    detected: bool
    recovered_s: float | None
    cells_lost: int
    violations: tuple[Violation, ...]
    checked: tuple[str, ...] = ()
    struck: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "nemesis": self.nemesis,
            "target": self.target,
            "struck": self.struck,
            "detected": self.detected,
            "recovered_s": self.recovered_s,
            "cells_lost": self.cells_lost,
            "checked": list(self.checked),
            "violations": [_violation(v) for v in self.violations],
        }


@attrs.frozen
class NemesisSummary:
    """One nemesis over a run: how often it was injected, the invariants checked after
    it, and the violations found after it, by invariant."""

    nemesis: str
    injected: int
    checked: tuple[str, ...]
    violations: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "nemesis": self.nemesis,
            "injected": self.injected,
            "checked": list(self.checked),
            "violations": dict(self.violations),
        }


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

    def by_nemesis(self) -> tuple[NemesisSummary, ...]:
        """Each nemesis of the run, in the order it first struck."""
        names = dict.fromkeys(f.nemesis for f in self.faults)
        summaries = []
        for name in names:
            faults = [f for f in self.faults if f.nemesis == name]
            broken: dict[str, int] = {}
            for v in (v for f in faults for v in f.violations):
                broken[invariant_of(v)] = broken.get(invariant_of(v), 0) + 1
            checked = dict.fromkeys(i for i in INVARIANTS for f in faults if i in f.checked)
            summaries.append(
                NemesisSummary(name, sum(f.struck for f in faults), tuple(checked), broken)
            )
        return tuple(summaries)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: the run, each fault, each nemesis, the invariants."""
        return {
            "seed": self.seed,
            "ok": self.ok,
            "cells": self.cells,
            "cells_ok": self.cells_ok,
            "faults": [f.as_dict() for f in self.faults],
            "nemeses": [n.as_dict() for n in self.by_nemesis()],
            "invariants": {name: promise for name, (promise, _) in INVARIANTS.items()},
        }

    def json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def table(self) -> str:
        """The report as plain-text tables (faults, then nemeses), the violations under them."""
        lines = _aligned([_COLUMNS, *(_row(f) for f in self.faults)])
        lines += [""]
        lines += _aligned([_NEMESIS_COLUMNS, *(_nemesis_row(n) for n in self.by_nemesis())])
        lines += [f"fault {f.number}: {v}" for f in self.faults for v in f.violations]
        lines.append(
            f"seed {self.seed}: {len(self.faults)} faults, {self.cells_ok}/{self.cells} cells "
            f"ok, {sum(f.cells_lost for f in self.faults)} lost, "
            f"{len(self.violations)} violations"
        )
        return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` in columns, the first a header underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _nemesis_row(summary: NemesisSummary) -> tuple[str, ...]:
    broken = ", ".join(f"{n} {name}" for name, n in summary.violations.items()) or "0"
    return (summary.nemesis, str(summary.injected), broken, ", ".join(summary.checked))


def _violation(v: Violation) -> dict[str, str]:
    return {"kind": v.kind, "invariant": invariant_of(v), "detail": v.detail}


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
