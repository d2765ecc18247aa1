"""Where a replica's interrupt lands: the cell's user code, before it, or before the cell."""

from __future__ import annotations

from nbos.kernel.replica._interrupts import CellInterrupts


def test_an_interrupt_in_user_code_signals_and_one_before_it_stops_the_cell() -> None:
    signals: list[str] = []
    interrupts = CellInterrupts()
    interrupts.request_began("a")
    assert interrupts.enter_user_code()
    interrupts.interrupt("a", lambda: signals.append("a"))
    assert signals == ["a"]
    interrupts.leave_user_code()
    interrupts.interrupt(None, lambda: signals.append("claimed"))  # after the code, kept
    assert signals == ["a"]
    interrupts.request_ended("a")
    interrupts.request_began("b")
    assert interrupts.enter_user_code()  # what was kept ended with its request


def test_an_interrupt_naming_a_cell_that_has_not_come_is_kept_for_it() -> None:
    interrupts = CellInterrupts()
    interrupts.interrupt("late", lambda: None)
    interrupts.request_began("other")
    assert interrupts.enter_user_code()
    interrupts.leave_user_code()
    interrupts.request_ended("other")
    interrupts.request_began("late")
    assert not interrupts.enter_user_code()
    interrupts.leave_user_code()
    interrupts.request_ended("late")
    interrupts.request_began("late")  # sent again (its claim lost): it runs this time
    assert interrupts.enter_user_code()


def test_an_interrupt_without_a_request_is_dropped_and_few_early_ones_are_kept() -> None:
    interrupts = CellInterrupts()
    interrupts.interrupt(None, lambda: None)
    for i in range(100):
        interrupts.interrupt(f"gone-{i}", lambda: None)
    interrupts.request_began("gone-0")  # forgotten long ago
    assert interrupts.enter_user_code()
    interrupts.leave_user_code()
    interrupts.request_ended("gone-0")
    interrupts.request_began("gone-99")
    assert not interrupts.enter_user_code()
