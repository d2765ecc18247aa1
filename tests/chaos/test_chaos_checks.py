"""The chaos toolkit's checkers, schedule and report, on histories made up to break them."""

from __future__ import annotations

import json

import pytest

from nbos.chaos import (
    INVARIANTS,
    CellRecord,
    ChaosReport,
    FaultReport,
    FreezeReplica,
    KillExecutor,
    KillFollower,
    KillGateway,
    Observed,
    Outcome,
    Violation,
    check_appends,
    check_digests,
    check_effects,
    check_execution_counts,
    check_outcomes,
    check_runs,
    check_supported,
    default_nemeses,
    known_nemeses,
    plan_faults,
)
from nbos.core.errors import ConfigError, NemesisUnsupportedError


def cell(
    seq: int, outcome: Outcome = "ok", ename: str | None = None, at: float = 100.0
) -> CellRecord:
    return CellRecord(seq, 1, outcome, ename, seq, 1, at)


def kinds(violations: list[Violation]) -> list[str]:
    return [v.kind for v in violations]


HISTORY = [
    cell(1),
    cell(2),
    cell(3, "lost", "CellLostError"),
    cell(4),
    cell(5, "unknown", "E"),
    cell(6, "indeterminate", "QuorumLostError"),
]


def test_a_clean_history_has_no_violation() -> None:
    observed = Observed(n=3, appended=(1, 2, 4), ran={1: (1.0,), 2: (2.0,), 4: (4.0,)})
    assert check_effects(HISTORY, observed) == []
    assert check_runs(HISTORY, observed.ran) == []
    # An unknown or indeterminate outcome may have applied once.
    assert check_effects(HISTORY, Observed(5, (1, 2, 4, 5, 6), {})) == []


def test_a_duplicated_acknowledged_cell_is_a_violation() -> None:
    found = check_effects(HISTORY, Observed(n=4, appended=(1, 2, 2, 4), ran={}))
    assert kinds(found) == ["exactly-once", "order"]
    assert "cell 2 applied 2x" in str(found[0])


def test_a_missing_acknowledged_cell_is_a_violation() -> None:
    found = check_effects(HISTORY, Observed(n=2, appended=(1, 4), ran={}))
    assert kinds(found) == ["exactly-once"]


def test_a_lost_cell_that_left_its_effect_is_a_violation() -> None:
    found = check_effects(HISTORY, Observed(n=4, appended=(1, 2, 3, 4), ran={}))
    assert kinds(found) == ["lost-applied"]
    assert "CellLostError" in found[0].detail


def test_an_unknown_cell_applied_twice_a_phantom_and_a_torn_cell_are_violations() -> None:
    found = check_effects(HISTORY, Observed(n=7, appended=(1, 2, 4, 5, 5, 9), ran={}))
    assert kinds(found) == ["exactly-once", "phantom", "torn-cell", "order"]


def test_an_indeterminate_cell_applied_twice_is_a_violation() -> None:
    found = check_effects(HISTORY, Observed(n=5, appended=(1, 2, 4, 6, 6), ran={}))
    assert kinds(found) == ["exactly-once", "order"]
    assert "QuorumLostError" in found[0].detail


def test_a_cell_that_ran_twice_or_after_it_was_reported_lost_is_a_violation() -> None:
    lost = cell(3, "lost", "CellLostError", at=100.0)
    assert check_runs([lost], {3: (99.5,)}) == []  # ran, then died: reported after
    found = check_runs([cell(1), lost], {1: (1.0, 2.0), 3: (107.0,)})
    assert kinds(found) == ["ran-twice", "ran-after-lost"]
    assert "7.000 s after" in found[1].detail


def test_an_outcome_the_kernel_does_not_define_is_a_violation() -> None:
    # Cell 5's "E" is one; cell 6's QuorumLostError (no outcome yet) is not.
    assert [v.detail for v in check_outcomes(HISTORY)] == [
        "cell 5 ended with E, not an answer the kernel defines"
    ]


def test_execution_count_must_grow() -> None:
    assert check_execution_counts([1, 2, 5, 6]) == []
    assert kinds(check_execution_counts([1, 2, 2, 3, 1])) == ["execution-count"] * 2


def test_replicas_must_agree_and_all_answer() -> None:
    assert check_digests({1: "a", 2: "a", 3: "a"}, [1, 2, 3], after=9) == []
    found = check_digests({1: "a", 3: "b"}, [1, 2, 3], after=9)
    assert kinds(found) == ["unsettled", "diverged"]


def test_the_report_lists_faults_and_violations() -> None:
    bad = Violation("exactly-once", "acknowledged cell 2 applied 2x")
    faults = (
        FaultReport(1, "kill-executor", "replica 1 (executor)", True, 0.42, 1, ()),
        FaultReport(2, "freeze-follower", "replica 3 for 1.5 s", False, None, 0, (bad,)),
    )
    report = ChaosReport(seed=7, faults=faults, cells=12, cells_ok=10)
    assert not report.ok and report.violations == (bad,)
    lines = report.table().splitlines()
    assert (
        lines[0]
        == "#  fault            target                detected  recovered  lost  violations"
    )
    assert lines[2] == "1  kill-executor    replica 1 (executor)  y         0.4 s      1     0"
    assert "never" in lines[3] and " n " in lines[3]
    assert "fault 2: exactly-once: acknowledged cell 2 applied 2x" in lines
    assert lines[-1] == "seed 7: 2 faults, 10/12 cells ok, 1 lost, 1 violations"
    assert ChaosReport(seed=7, faults=faults[:1], cells=3, cells_ok=3).ok


def test_the_report_shows_each_nemesis_with_its_injections_and_invariants() -> None:
    gone = Violation("kernel-dead", "kernel k2 is no longer listed by the gateway")
    bad = Violation("control-input", "WatchKernel wait_s=NaN was answered nothing")
    checked = ("defined-outcome", "recovers", "no-healthy-kernel-dead", "exactly-once")
    faults = (
        FaultReport(1, "freeze-gateway", "the gateway", True, 1.0, 0, (), checked),
        FaultReport(2, "malformed-requests", "29 of 30", True, 0.5, 0, (gone, bad),
                    (*checked, "control-input")),
        FaultReport(3, "freeze-gateway", "not struck", False, 0.2, 0, (), checked, False),
    )  # fmt: skip
    report = ChaosReport(seed=3, faults=faults, cells=9, cells_ok=9)
    freeze, malformed = report.by_nemesis()
    assert (freeze.nemesis, freeze.injected, freeze.violations) == ("freeze-gateway", 1, {})
    assert freeze.checked == ("defined-outcome", "exactly-once", "recovers",
                              "no-healthy-kernel-dead")  # fmt: skip
    assert malformed.violations == {"no-healthy-kernel-dead": 1, "control-input": 1}
    assert "control-input" in malformed.checked
    lines = report.table().splitlines()
    assert lines[5] == ""
    assert lines[6].split() == ["nemesis", "injected", "violations", "invariants", "checked"]
    assert lines[8].split()[:3] == ["freeze-gateway", "1", "0"]
    assert lines[9].startswith("malformed-requests  1         1 no-healthy-kernel-dead, 1 "
                               "control-input")  # fmt: skip
    assert lines[-1] == "seed 3: 3 faults, 9/9 cells ok, 0 lost, 2 violations"
    data = json.loads(report.json())
    assert data["ok"] is False
    assert data["nemeses"][1] == {
        "nemesis": "malformed-requests",
        "injected": 1,
        "checked": list(malformed.checked),
        "violations": {"no-healthy-kernel-dead": 1, "control-input": 1},
    }
    assert data["faults"][1]["violations"][0] == {
        "kind": "kernel-dead", "invariant": "no-healthy-kernel-dead", "detail": gone.detail
    }  # fmt: skip
    assert set(data["invariants"]) == set(INVARIANTS)


def test_a_kernel_must_hold_each_acknowledged_append_once() -> None:
    assert check_appends("k", [1, 2, 3], [1, 2, 3, 4]) == []  # 4: unacknowledged, once
    assert kinds(check_appends("k", [1, 2, 3], [1, 3])) == ["kernel-state"]
    assert kinds(check_appends("k", [1, 2], [1, 2, 2])) == ["kernel-state"]
    assert kinds(check_appends("k", [1], [1, 4, 4])) == ["kernel-state"]
    assert "appends 2 0x, 3 2x" in check_appends("k", [1, 2, 3], [1, 3, 3])[0].detail


def test_a_seed_replays_the_same_schedule() -> None:
    names = [n.name for n in default_nemeses()]

    def first(seed: int) -> list[object]:
        plan = plan_faults(seed, names)
        return [next(plan) for _ in range(20)]

    assert first(7) == first(7)
    assert first(7) != first(8)
    assert {f.nemesis for f in first(7)} == set(names)


def test_nemeses_that_need_a_gateway_are_refused_on_the_embedded_cluster() -> None:
    check_supported(default_nemeses())
    with pytest.raises(NemesisUnsupportedError, match=r"kill-gateway.*gateway"):
        check_supported([KillExecutor(), KillGateway()])
    refused = {n.name for n in known_nemeses()} - {n.name for n in default_nemeses()}
    assert refused == {
        "partition-host",
        "kill-gateway",
        "kill-agent",
        "freeze-gateway",
        "freeze-agent",
        "cpu-hog",
        "fill-disk",
        "start-flood",
        "malformed-requests",
    }
    for nemesis in known_nemeses():
        if nemesis.name in refused:
            with pytest.raises(NemesisUnsupportedError):
                check_supported([nemesis])
    with pytest.raises(ConfigError):
        check_supported([KillFollower(), KillFollower()])  # one name twice
    with pytest.raises(ConfigError):
        check_supported([])


def test_a_freeze_needs_a_sound_hold_range() -> None:
    with pytest.raises(ConfigError):
        FreezeReplica(hold_s=(3.0, 1.0))
    assert FreezeReplica("follower").name == "freeze-follower"
