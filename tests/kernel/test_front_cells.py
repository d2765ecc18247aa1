"""The front's cell protocol (exec indices, claims, settles), driven without sockets.

The replicas are a table of what each would answer; everything else is the real
:class:`Cells`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from nbos.core.errors import KernelError, QuorumLostError
from nbos.kernel import protocol
from nbos.kernel.front._cells import CLAIM_ATTEMPTS, CellRefused, Cells, lost_cell_reply

pytestmark = pytest.mark.anyio


@attrs.define
class Replicas:
    """Three replicas, of which ``alive`` answer; ``settles`` says whether a settle commits."""

    alive: tuple[int, ...] = (1, 2, 3)
    members: tuple[int, ...] = (1, 2, 3)
    settles: bool = True
    #: What ``nbos_progress_request`` gets from each replica.
    progress: dict[int, dict[str, Any]] = attrs.Factory(dict)
    #: The control requests asked, in order: ``(replica, msg_type, content)``.
    asked: list[tuple[int, str, dict[str, Any]]] = attrs.Factory(list)

    @property
    def has_quorum(self) -> bool:
        return len(self.alive) * 2 > len(self.members)

    async def ask(
        self,
        replica: int,
        msg_type: str,
        content: Mapping[str, Any],
        *,
        timeout: float,
        needs_quorum: bool = False,
    ) -> dict[str, Any] | None:
        self.asked.append((replica, msg_type, dict(content)))
        if msg_type == protocol.PROGRESS_REQUEST:
            return {"content": {"status": "ok", **self.progress.get(replica, {})}}
        assert msg_type == protocol.LOST_REQUEST and needs_quorum
        if not self.settles:
            return None
        return {"content": {"status": "ok", protocol.CELL_STATUS: "lost", "execution_count": 0}}

    def settled(self) -> list[int]:
        return [c[protocol.LOST_INDEX] for _, t, c in self.asked if t == protocol.LOST_REQUEST]


def cells_of(replicas: Replicas) -> Cells:
    return Cells("k", replicas, replicas.ask)


class Executor:
    """Runs cells on replica 1; the claims of the indices in ``claimed`` are lost."""

    def __init__(self, claimed: set[int] | None = None) -> None:
        self.claimed = claimed or set()
        self.tried: list[int] = []

    async def choose(self, index: int) -> int:
        return 1

    async def execute(self, index: int, plan: int) -> str | None:
        self.tried.append(index)
        return None if index in self.claimed else "ok"


async def test_cells_get_consecutive_indices_and_settle_in_order() -> None:
    cells, run = cells_of(Replicas()), Executor()
    for expected in (1, 2, 3):
        assert await cells.run(run.choose, run.execute) == "ok"
        assert cells.last_exec_index == cells.settled_exec_index == expected
    assert run.tried == [1, 2, 3]


async def test_a_lost_claim_retires_its_index_and_the_cell_goes_again_under_the_next() -> None:
    replicas = Replicas()
    cells, run = cells_of(replicas), Executor(claimed={1})
    assert await cells.run(run.choose, run.execute) == "ok"
    assert run.tried == [1, 2]
    assert replicas.settled() == [1]
    assert cells.settled_exec_index == 2


async def test_a_cell_whose_claims_all_lose_fails_after_as_many_indices() -> None:
    replicas = Replicas()
    cells, run = cells_of(replicas), Executor(claimed=set(range(1, 10)))
    with pytest.raises(CellRefused) as refused:
        await cells.run(run.choose, run.execute)
    assert isinstance(refused.value.error, KernelError)
    assert replicas.settled() == run.tried == list(range(1, CLAIM_ATTEMPTS + 1))
    assert cells.settled_exec_index == 0


async def test_a_chooser_failure_gives_the_index_back() -> None:
    cells, run = cells_of(Replicas()), Executor()

    async def no_gpus(index: int) -> int:
        raise QuorumLostError("no GPUs")

    with pytest.raises(CellRefused, match="no GPUs"):
        await cells.run(no_gpus, run.execute)
    assert cells.last_exec_index == 0
    assert await cells.run(run.choose, run.execute) == "ok"
    assert run.tried == [1]


async def test_without_a_majority_a_cell_is_refused_before_it_takes_an_index() -> None:
    cells, run = cells_of(Replicas(alive=(2,))), Executor()
    with pytest.raises(CellRefused, match=r"only replicas \[2\] of \[1, 2, 3\]") as refused:
        await cells.run(run.choose, run.execute)
    assert isinstance(refused.value.error, QuorumLostError)
    assert run.tried == [] and cells.last_exec_index == 0


async def test_an_index_no_majority_settled_blocks_cells_until_it_is_settled() -> None:
    replicas = Replicas(settles=False)
    cells, run = cells_of(replicas), Executor(claimed={1})
    with pytest.raises(CellRefused):
        await cells.run(run.choose, run.execute)
    assert cells.has_unsettled
    with pytest.raises(CellRefused, match=r"cells \[1\] could not be settled"):
        await cells.run(run.choose, run.execute)
    assert run.tried == [1]
    replicas.settles = True
    assert await cells.run(run.choose, run.execute) == "ok"
    assert not cells.has_unsettled
    # Index 1 was settled before the cell ran, under the next index.
    assert replicas.settled()[-1] == 1 and run.tried == [1, 2]


async def test_a_dead_executors_cell_is_settled_and_nobody_is_its_last_executor() -> None:
    replicas = Replicas()
    cells = cells_of(replicas)
    cells.ran_on(1)
    content = await cells.lost(4, 1)
    assert content["ename"] == "CellLostError"
    assert replicas.settled() == [4] and cells.last_executor is None


def test_what_a_settle_says_becomes_the_dead_executors_reply() -> None:
    def settled(status: str, count: int) -> dict[str, Any]:
        return {"status": "ok", protocol.CELL_STATUS: status, protocol.EXECUTION_COUNT: count}

    lost = lost_cell_reply(3, 2, settled("lost", 5))
    assert (lost["ename"], lost["execution_count"]) == ("CellLostError", 5)
    # The executor committed the cell before it died: the reply says what it did.
    ok = lost_cell_reply(3, 2, settled("ok", 6))
    assert (ok["status"], ok["execution_count"]) == ("ok", 5)
    failed = lost_cell_reply(3, 2, settled("error", 6))
    assert (failed["status"], failed["ename"]) == ("error", "KernelError")
    assert lost_cell_reply(3, 2, None)["ename"] == "QuorumLostError"


async def test_a_front_taking_over_goes_on_after_the_last_committed_cell() -> None:
    replicas = Replicas(alive=(1, 3))
    replicas.progress = {
        1: {protocol.LAST_DONE: 6, protocol.NEXT_CLAIMED_BY: 3},
        3: {protocol.LAST_DONE: 5, protocol.NEXT_CLAIMED_BY: 1},
    }
    cells = cells_of(replicas)
    await cells.resume()
    assert (cells.settled_exec_index, cells.last_exec_index, cells.last_executor) == (6, 6, 3)
    # A claimant that is not alive is nobody's last executor.
    replicas.progress[1][protocol.NEXT_CLAIMED_BY] = 2
    cells = cells_of(replicas)
    await cells.resume()
    assert (cells.settled_exec_index, cells.last_executor) == (6, None)
