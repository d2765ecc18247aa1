"""How the kernel's thread waits for its Raft member's results (``_result``)."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from nbos.core.config import RaftSettings
from nbos.core.errors import LogClosedError, ProposalTimeoutError
from nbos.core.ids import KernelId, NodeId
from nbos.core.wire.entries import Claim
from nbos.kernel.replica._machine import KernelStateMachine, Outcome
from nbos.kernel.replica._member_thread import (
    BLOCKING_WAIT_S,
    RaftMemberThread,
    _result,
    _settle,
)
from nbos.raft import Outcome as RaftOutcome
from nbos.transport.ports import free_loopback_ports
from tests._wait import eventually

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


@pytest.mark.parametrize("after", [0.0, 30 * BLOCKING_WAIT_S])
async def test_a_member_that_stops_is_a_closed_log(after: float) -> None:
    # Both while the caller waits blocked and once it waits on its loop.
    future = settle_later(after, lambda f: f.cancel())
    with pytest.raises(LogClosedError):
        await _result(future)


async def test_a_caller_that_gives_up_is_cancelled_and_the_late_result_is_dropped() -> None:
    future = settle_later(30 * BLOCKING_WAIT_S, lambda f: f.set_result("late"))
    with anyio.move_on_after(10 * BLOCKING_WAIT_S) as scope:
        await _result(future)
    assert scope.cancelled_caught
    with anyio.fail_after(30):
        while not future.done():  # noqa: ASYNC110 - a thread settles it
            await anyio.sleep(BLOCKING_WAIT_S)
    await anyio.sleep(BLOCKING_WAIT_S)  # its copy-over to the loop runs, harmlessly


async def test_a_member_s_proposals_from_many_threads_commit_in_order_and_stop_fails_them(
    tmp_path: Path,
) -> None:
    (port,) = free_loopback_ports(1)
    member = RaftMemberThread(
        kernel_id=KernelId("k"),
        node_id=NodeId(1),
        peers={NodeId(1): f"tcp://127.0.0.1:{port}"},
        data_dir=tmp_path,
        machine=KernelStateMachine(lambda event: None),
        settings=RaftSettings(tick_ms=5, election_ticks=4),
    )
    member.start()
    try:
        await eventually(lambda: member.leader_id == 1, timeout=30)
        # Three replicas' claims of each of 10 cells, all at once, each from a thread of
        # its own: one at a time they commit (a seq out of order would be dropped as a
        # retry, and its caller would never hear back), and each caller gets its own.
        outcomes: dict[tuple[int, int], Outcome] = {}

        def claim(cell: int, replica: int) -> None:
            outcomes[cell, replica] = anyio.run(member.propose, Claim(cell, replica))

        async with anyio.create_task_group() as tg:
            for cell, replica in itertools.product(range(1, 11), (1, 2, 3)):
                tg.start_soon(anyio.to_thread.run_sync, claim, cell, replica)
        for cell in range(1, 11):
            mine = [outcomes[cell, r] for r in (1, 2, 3)]
            (winner,) = [r for r, o in zip((1, 2, 3), mine, strict=True) if o.accepted]
            assert all(o.winner == winner for o in mine)
        assert len({o.index for o in outcomes.values()}) == 30
    finally:
        member.stop()
    with pytest.raises(LogClosedError):
        await member.propose(Claim(21, 1))


async def test_proposals_waiting_for_a_quorum_fail_as_closed_when_the_member_stops(
    tmp_path: Path,
) -> None:
    ports = free_loopback_ports(3)
    # Members 2 and 3 never start: nothing can commit, the first proposal stays in
    # flight and the others queue behind it.
    member = RaftMemberThread(
        kernel_id=KernelId("k"),
        node_id=NodeId(1),
        peers={NodeId(n): f"tcp://127.0.0.1:{p}" for n, p in zip((1, 2, 3), ports, strict=True)},
        data_dir=tmp_path,
        machine=KernelStateMachine(lambda event: None),
        settings=RaftSettings(tick_ms=5, election_ticks=4),
    )
    member.start()
    errors: list[BaseException] = []

    def claim(cell: int) -> None:
        try:
            anyio.run(member.propose, Claim(cell, 1))
        except LogClosedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for cell in range(1, 4):
            tg.start_soon(anyio.to_thread.run_sync, claim, cell)
        await anyio.sleep(0.5)
        await anyio.to_thread.run_sync(member.stop)
    assert len(errors) == 3


async def test_an_outcome_for_a_wait_given_up_meanwhile_is_dropped() -> None:
    for settle in (lambda o: o.set(b"outcome"), lambda o: o.fail(ProposalTimeoutError("late"))):
        given_up: Future[bytes] = Future()
        given_up.cancel()
        outcome: RaftOutcome[bytes] = RaftOutcome()
        settle(outcome)
        _settle(given_up, outcome)  # on the member's thread: must not raise
        assert given_up.cancelled()


async def test_an_outcome_reaches_the_waiting_thread_as_a_result_or_as_its_error() -> None:
    applied: Future[bytes] = Future()
    outcome: RaftOutcome[bytes] = RaftOutcome()
    outcome.set(b"outcome")
    _settle(applied, outcome)
    assert applied.result() == b"outcome"
    failed: Future[bytes] = Future()
    refused: RaftOutcome[bytes] = RaftOutcome()
    refused.fail(ProposalTimeoutError("no quorum"))
    _settle(failed, refused)
    with pytest.raises(ProposalTimeoutError, match="no quorum"):
        failed.result()
