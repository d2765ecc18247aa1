"""The linearizability checker on known histories, and on generated ones of both kinds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.linearizability import Operation, check, check_register, step


def op(
    kind: str,
    call: float,
    ret: float,
    value: str = "",
    output: str | int | None = None,
    key: str = "k",
    client: str = "c",
) -> Operation:
    return Operation(client, call, ret, kind, key, value, output)


def unknown(kind: str, call: float, value: str, key: str = "k") -> Operation:
    return Operation("c", call, math.inf, kind, key, value, known=False)


# --- known histories -----------------------------------------------------------------


def test_sequential_history_is_linearizable() -> None:
    history = [
        op("get", 0, 1, output=None),
        op("put", 2, 3, "a"),
        op("get", 4, 5, output="a"),
        op("append", 6, 7, "b", output=2),
        op("get", 8, 9, output="ab"),
    ]
    assert check(history) == []


def test_stale_read_after_a_completed_write_is_not() -> None:
    history = [op("put", 0, 1, "a"), op("put", 2, 3, "b"), op("get", 4, 5, output="a")]
    assert check(history) == ["k"]


def test_a_read_concurrent_with_a_write_may_see_either_value() -> None:
    for seen in ("a", "b"):
        history = [op("put", 0, 1, "a"), op("put", 2, 6, "b"), op("get", 3, 4, output=seen)]
        assert check(history) == []


def test_reads_cannot_go_back_in_time() -> None:
    # the write is concurrent with both reads, but the first read saw the new
    # value and returned before the second one started: the second cannot see the old
    history = [
        op("put", 0, 1, "a"),
        op("put", 2, 10, "b"),
        op("get", 3, 4, output="b", client="r1"),
        op("get", 5, 6, output="a", client="r2"),
    ]
    assert check(history) == ["k"]


def test_a_value_never_written_is_not_linearizable() -> None:
    assert check([op("put", 0, 1, "a"), op("get", 2, 3, output="z")]) == ["k"]


def test_appends_apply_once_and_in_real_time_order() -> None:
    assert check([op("append", 0, 1, "a"), op("get", 2, 3, output="aa")]) == ["k"]
    reordered = [op("append", 0, 1, "a"), op("append", 2, 3, "b"), op("get", 4, 5, output="ba")]
    assert check(reordered) == ["k"]
    concurrent = [op("append", 0, 3, "a"), op("append", 1, 2, "b"), op("get", 4, 5, output="ba")]
    assert check(concurrent) == []


def test_append_length_output_is_checked() -> None:
    assert check([op("append", 0, 1, "a", output=1), op("append", 2, 3, "b", output=2)]) == []
    assert check([op("append", 0, 1, "a", output=1), op("append", 2, 3, "b", output=1)]) == ["k"]


def test_a_write_of_unknown_outcome_may_or_may_not_take_effect() -> None:
    seen = [unknown("put", 0, "a"), op("get", 1, 2, output="a"), op("get", 3, 4, output="a")]
    assert check(seen) == []
    unseen = [unknown("put", 0, "a"), op("get", 1, 2, output=None)]
    assert check(unseen) == []
    # but once seen it cannot be unseen
    flicker = [unknown("put", 0, "a"), op("get", 1, 2, output="a"), op("get", 3, 4, output=None)]
    assert check(flicker) == ["k"]


def test_an_unknown_write_takes_effect_only_after_it_was_sent() -> None:
    assert check([op("get", 0, 1, output="a"), unknown("put", 2, "a")]) == ["k"]


def test_keys_are_checked_independently() -> None:
    history = [
        op("put", 0, 1, "a", key="x"),
        op("get", 2, 3, output="a", key="x"),
        op("put", 0, 1, "b", key="y"),
        op("get", 2, 3, output="c", key="y"),
    ]
    assert check(history) == ["y"]


def test_touching_operations_count_as_concurrent() -> None:
    assert check([op("put", 0, 1, "a"), op("get", 1, 2, output=None)]) == []


def test_bad_operations_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown operation"):
        op("delete", 0, 1)
    with pytest.raises(ValueError, match="before it is called"):
        op("get", 2, 1)
    with pytest.raises(ValueError, match="read of unknown outcome"):
        Operation("c", 0, math.inf, "get", "k", known=False)


# --- generated histories ---------------------------------------------------------------

# A sequential run of the model, each operation stretched over a random interval
# around its instant, is linearizable by construction; breaking one read's output
# makes it not, as long as that read overlaps nothing that could explain it.

_kinds = st.sampled_from(["put", "append", "get"])
_values = st.sampled_from(["a", "b", "c"])
_spans = st.tuples(st.floats(0, 15), st.floats(0, 15))  # instants are 10 apart: overlaps


@st.composite
def linearizable_histories(draw: st.DrawFn) -> list[Operation]:
    state: str | None = None
    history = []
    for instant in range(0, 10 * draw(st.integers(1, 12)), 10):
        kind, value = draw(_kinds), draw(_values)
        before, after = draw(_spans)
        probe = Operation("c", 0, 0, kind, "k", value)
        _, state_after = step(state, probe)
        recorded = draw(st.booleans())  # writes may or may not report the new length
        written = len(state_after or "") if recorded else None
        output = state if kind == "get" else written
        history.append(Operation("c", instant - before, instant + after, kind, "k", value, output))
        state = state_after
    return history


@settings(max_examples=200)
@given(linearizable_histories())
def test_generated_linearizable_histories_pass(history: list[Operation]) -> None:
    assert check_register(history)


@settings(max_examples=200)
@given(linearizable_histories(), st.data())
def test_a_read_of_a_value_never_held_fails(history: list[Operation], data: st.DataObject) -> None:
    reads = [i for i, o in enumerate(history) if o.kind == "get"]
    if not reads:
        history.append(Operation("c", 1000, 1001, "get", "k", output=None))
        reads = [len(history) - 1]
    i = data.draw(st.sampled_from(reads))
    # "z" is no value any write produces, alone or appended
    history[i] = Operation("c", history[i].call, history[i].ret, "get", "k", output="z")
    assert not check_register(history)
