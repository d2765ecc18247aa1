"""How the kernel's thread waits for its Raft member's results (``_result``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import anyio
import anyio.lowlevel
import pytest

from nbos.core.errors import LogClosedError, ProposalTimeoutError
from nbos.kernel.replica._member_thread import BLOCKING_WAIT_S, _result, _settle, _settle_from

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settle_later(delay: float, settle: object) -> Future[str]:
    """A future that another thread settles after ``delay`` s with ``settle(future)``."""
    future: Future[str] = Future()

    def run() -> None:
        time.sleep(delay)
        settle(future)  # type: ignore[operator]

    threading.Thread(target=run, daemon=True).start()
    return future


async def test_a_quick_result_is_returned() -> None:
    future = settle_later(0.0, lambda f: f.set_result("done"))
    assert await _result(future) == "done"


async def test_a_slow_result_is_awaited_on_the_loop_which_serves_others_meanwhile() -> None:
    slow = 30 * BLOCKING_WAIT_S
    future = settle_later(slow, lambda f: f.set_result("late"))
    turns: list[float] = []

    async def other_task() -> None:
        while True:
            turns.append(time.monotonic())
            await anyio.sleep(BLOCKING_WAIT_S / 4)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.lowlevel.checkpoint()  # the other task's first turn
        started = time.monotonic()
        with anyio.fail_after(30):
            assert await _result(future) == "late"
        tg.cancel_scope.cancel()
    # The loop was held for the blocked part of the wait only: the other task ran after it.
    assert any(t > started + BLOCKING_WAIT_S for t in turns)


async def test_the_member_s_error_is_raised_as_it_is() -> None:
    future = settle_later(0.0, lambda f: f.set_exception(ProposalTimeoutError("no quorum")))
    with pytest.raises(ProposalTimeoutError, match="no quorum"):
        await _result(future)


async def test_a_member_that_stops_is_a_closed_log() -> None:
    future = settle_later(0.0, lambda f: f.cancel())
    with pytest.raises(LogClosedError):
        await _result(future)


def test_the_proposing_task_s_end_settles_the_wait_unless_the_entry_applied_first() -> None:
    # The entry applied (the driver's on_applied): the task's later end changes nothing.
    applied: Future[bytes] = Future()
    _settle(applied, b"outcome")
    running: Future[bytes] = Future()
    running.set_exception(ProposalTimeoutError("late"))
    _settle_from(applied, running)
    assert applied.result() == b"outcome"
    # It failed before applying (no quorum): the caller gets the task's error.
    failed: Future[bytes] = Future()
    _settle_from(failed, running)
    with pytest.raises(ProposalTimeoutError, match="late"):
        failed.result()
    # The member stopped: its tasks are cancelled, and so is the caller's wait.
    stopped: Future[bytes] = Future()
    cancelled: Future[bytes] = Future()
    cancelled.cancel()
    _settle_from(stopped, cancelled)
    assert stopped.cancelled()


def test_a_result_for_a_wait_given_up_meanwhile_is_dropped() -> None:
    given_up: Future[bytes] = Future()
    given_up.cancel()
    _settle(given_up, b"outcome")  # on the member's thread: must not raise
    assert given_up.cancelled()
