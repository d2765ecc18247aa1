"""Fixtures for the deployment tests: anyio on asyncio (the control API client is zmq.asyncio)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
