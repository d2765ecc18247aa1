"""Fixtures for the host agent tests: anyio on asyncio, agent processes, a fake gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.agent._daemons import AgentProcess, FakeGateway, end_replicas, fake_gateway


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    """Agents a test starts; each is SIGKILLed and its recorded replicas ended afterwards."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill()
        agent.wait()
        end_replicas(agent.state_dir)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[FakeGateway]:
    async with fake_gateway(tmp_path) as gw:
        yield gw
