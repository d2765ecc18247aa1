"""Fixtures for the embedded-cluster tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"
