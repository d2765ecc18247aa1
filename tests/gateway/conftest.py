"""Fixtures for the gateway tests: anyio on asyncio, agent processes started outside a gateway."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.agent._daemons import AgentProcess, end_replicas


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    """Agents a test starts; each is resumed, SIGKILLed and its recorded replicas ended
    afterwards (a test may leave one stopped)."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill(signal.SIGCONT)
        agent.kill()
        agent.wait()
        end_replicas(agent.state_dir)
