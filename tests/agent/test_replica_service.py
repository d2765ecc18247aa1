"""The agent's replica processes, in process: a stop that comes while its start is under way."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from nbos.agent._replicas import ReplicaService
from nbos.core.ids import HostId
from nbos.core.wire.agent import ReplicaInfo, ReplicaSpec
from tests.agent._daemons import DEADLINE, SLEEPER, alive

pytestmark = pytest.mark.anyio


async def test_a_stop_during_the_start_stops_the_replica_once_started(tmp_path: Path) -> None:
    """The gateway stops a start it gave up on (a timeout, a refused kernel); that stop may
    reach the agent while the start is still running there. Before, it answered "unknown
    replica" and the replica, started a moment later, ran on with no kernel (the flood of
    issue 27 left 181 such)."""
    exits: list[ReplicaInfo] = []

    async def report(info: ReplicaInfo) -> None:
        exits.append(info)

    started: list[ReplicaInfo] = []
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            service = await ReplicaService.open(HostId("h1"), tmp_path, "127.0.0.1", report, tg)

            async def start() -> None:
                started.append(await service.start("r1", ReplicaSpec(SLEEPER)))

            tg.start_soon(start)
            await anyio.lowlevel.checkpoint()  # the start runs up to its process spawning
            assert not started and service.infos() == []
            stopped = await service.stop("r1", grace=5.0)
            assert started, "the stop answered before the start it waited for"
            assert (stopped.running, stopped.signal) == (False, signal.SIGTERM)
            assert not alive(started[0].pid)
            assert [e.replica_id for e in exits] == ["r1"]
            tg.cancel_scope.cancel()
