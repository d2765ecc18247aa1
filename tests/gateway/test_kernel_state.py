"""A kernel's state, decided from its facts: every fact combination of small kernels, and
hypothesis over large ones, against what each state promises (``docs/kernel.md``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, get_args

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbos.core.errors import KernelDeadError, QuorumLostError
from nbos.gateway._kernel_state import (
    KERNEL_STATES,
    JupyterState,
    KernelFacts,
    KernelState,
    jupyter_state,
    kernel_state,
    majority,
    refusal,
)
from nbos.kernel.front import CellActivity

#: The states of a kernel that runs a cell sent to it.
RUNS_CELLS = frozenset({"idle", "busy", "waiting", "degraded"})
CELLS: tuple[CellActivity, ...] = get_args(CellActivity)


def small_kernels() -> Iterator[KernelFacts]:
    """Every valid combination of facts of kernels of up to 5 replicas."""
    flags = list(itertools.product((False, True), repeat=4))
    for members in range(6):
        for alive in range(members + 1):
            for unanswering in range(members - alive + 1):
                for cell in CELLS:
                    for started, recovering, replacing, closed in flags:
                        yield KernelFacts(
                            members,
                            alive,
                            unanswering,
                            cell,
                            started=started,
                            recovering=recovering,
                            replacing=replacing,
                            closed=closed,
                        )


@st.composite
def facts(draw: st.DrawFn) -> KernelFacts:
    members = draw(st.integers(0, 1000))
    alive = draw(st.integers(0, members))
    return KernelFacts(
        members,
        alive,
        draw(st.integers(0, members - alive)),
        draw(st.sampled_from(CELLS)),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
    )


def check(f: KernelFacts) -> None:
    """Everything a state promises, for the facts ``f``."""
    state = kernel_state(f)
    assert state in KERNEL_STATES
    can_run = f.started and not f.closed and majority(f.alive, f.members)
    # Never idle (nor busy, waiting, degraded) for a kernel that cannot run a cell; and a
    # kernel that can, and mends nothing, is one of those.
    if state in RUNS_CELLS:
        assert can_run, f
    if can_run and not (f.recovering or f.replacing):
        assert state in RUNS_CELLS, f
        expected = {"waiting": "waiting", "running": "busy"}.get(f.cell)
        if expected is None:
            expected = "idle" if f.alive == f.members else "degraded"
        assert state == expected, f
    if f.closed:
        assert state == "dead", f
    elif f.recovering:
        assert state == "recovering", f
    elif not f.started:
        assert state == "starting", f
    elif not majority(f.alive, f.members):
        # Suspicion is not proof: dead only when the replicas that may answer again are
        # no majority either. A replacement cannot help: it joins through a majority.
        could_come_back = majority(f.alive + f.unanswering, f.members)
        assert state == ("recovering" if could_come_back else "dead"), f
    elif f.replacing:
        assert state == "recovering", f


def test_every_state_of_small_kernels_keeps_its_promise() -> None:
    for f in small_kernels():
        check(f)


@given(facts())
def test_every_state_of_any_kernel_keeps_its_promise(f: KernelFacts) -> None:
    check(f)


@given(facts())
def test_a_replica_back_never_stops_a_kernel_running_cells_and_proof_only_makes_it_deader(
    f: KernelFacts,
) -> None:
    state = kernel_state(f)
    if f.alive < f.members:
        # An exited replica (or an unanswering one) is alive again.
        back = attrs.evolve(f, alive=f.alive + 1, unanswering=max(0, f.unanswering - 1))
        if state in RUNS_CELLS:
            assert kernel_state(back) in RUNS_CELLS
        if kernel_state(back) == "dead":
            assert state == "dead"
    if f.unanswering:
        # An unanswering replica is proven to have exited.
        proven = attrs.evolve(f, unanswering=f.unanswering - 1)
        if state == "dead":
            assert kernel_state(proven) == "dead"
        if kernel_state(proven) != "dead":
            assert kernel_state(proven) == state


def test_the_states_of_a_three_replica_kernel() -> None:
    def state(alive: int, unanswering: int = 0, **kw: Any) -> str:
        return kernel_state(KernelFacts(3, alive, unanswering, **kw))

    assert state(3) == "idle"
    assert state(2) == "degraded"
    assert state(2, cell="running") == "busy"
    assert state(3, cell="waiting") == "waiting"
    assert state(1) == "dead"
    assert state(0) == "dead"
    assert state(1, 1) == "recovering"  # one frozen replica, not known to have exited
    assert state(0, 3) == "recovering"
    assert state(1, recovering=True) == "recovering"  # a restart in place under way
    assert state(2, recovering=True, cell="running") == "recovering"
    assert state(2, replacing=True, cell="running") == "recovering"
    assert state(1, replacing=True) == "dead"  # no majority to join through
    assert state(3, started=False) == "starting"
    assert state(3, closed=True) == "dead"
    assert state(0, recovering=True, closed=True) == "dead"


JUPYTER: frozenset[str] = frozenset(get_args(JupyterState))


@pytest.mark.parametrize("state", KERNEL_STATES)
@pytest.mark.parametrize("activity", ["idle", "busy", "restarting"])
def test_execution_state_keeps_jupyters_words_and_never_says_idle_for_a_kernel_that_cannot_run(
    state: KernelState, activity: str
) -> None:
    shown = jupyter_state(state, activity)
    assert shown in JUPYTER
    if activity == "restarting":
        assert shown == "restarting"
    elif state in ("idle", "degraded"):
        assert shown == activity  # what the kernel's IOPub says, as any Jupyter kernel
    else:
        expected = {"dead": "dead", "starting": "starting"}.get(state, "busy")
        assert shown == expected


@given(facts())
def test_a_kernel_that_cannot_run_a_cell_names_why_and_says_dead_only_when_it_is(
    f: KernelFacts,
) -> None:
    if kernel_state(f) in RUNS_CELLS:
        return
    error = refusal("k-1", f, "only replicas [2] of [1, 2, 3] are alive")
    assert isinstance(error, QuorumLostError)
    assert isinstance(error, KernelDeadError) == (kernel_state(f) == "dead")
    assert "k-1" in str(error)
    if not f.closed:
        assert "only replicas [2] of [1, 2, 3] are alive" in str(error)


@pytest.mark.parametrize(
    ("members", "alive", "unanswering"), [(-1, 0, 0), (3, -1, 0), (3, 0, -1), (3, 2, 2), (2, 3, 0)]
)
def test_impossible_facts_are_refused(members: int, alive: int, unanswering: int) -> None:
    with pytest.raises(ValueError, match=r"negative|members"):
        KernelFacts(members, alive, unanswering)
