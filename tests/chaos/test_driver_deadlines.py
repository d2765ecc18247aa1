"""Proposal deadlines and shutdown of the Raft driver when the leader is cut off from its group.

The driver keeps proposal deadlines on a heap that its tick loop sweeps instead
of a timer per proposal; these check that a proposal that cannot commit still
ends on time with ``ProposalTimeoutError``, and that closing the log ends the
waiting proposals with ``LogClosedError`` long before their deadlines.
"""

from __future__ import annotations

import anyio
import pytest

from nbos.core.errors import LogClosedError, NotLeaderError, ProposalTimeoutError
from nbos.raft.kv import encode_command
from tests.raft.test_driver import group, peer

pytestmark = pytest.mark.anyio


async def test_a_proposal_without_quorum_times_out_on_time() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        others = [peer(n) for n in (1, 2, 3) if n != int(leader.node_id)]
        g.network.partition([peer(int(leader.node_id))], others)
        start = anyio.current_time()
        with anyio.fail_after(20), pytest.raises(ProposalTimeoutError):
            await leader.propose(encode_command("put", "k", "v"), timeout=0.3)
        # Not early, and not left to some later sweep; a loaded machine makes it late by
        # its own delays, which are no property of the driver: a generous bound.
        assert 0.3 <= anyio.current_time() - start < 3.0


async def test_closing_the_log_ends_waiting_proposals() -> None:
    async with group([1, 2, 3]) as g:
        leader = await g.leader()
        others = [peer(n) for n in (1, 2, 3) if n != int(leader.node_id)]
        g.network.partition([peer(int(leader.node_id))], others)
        errors: list[BaseException] = []

        async def propose(n: int) -> None:
            try:
                await leader.propose(encode_command("put", "k", str(n)), timeout=30.0)
            except (LogClosedError, ProposalTimeoutError, NotLeaderError) as exc:
                errors.append(exc)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    tg.start_soon(propose, n)
                await anyio.sleep(0.02)
                await leader.aclose()
        # those the node took before check-quorum deposed it end closed; a late
        # one may have been refused; none waited for its deadline
        assert len(errors) == 20
        assert not any(isinstance(e, ProposalTimeoutError) for e in errors)
        assert any(isinstance(e, LogClosedError) for e in errors)
