"""Fixtures for the GPU accounting tests."""

from __future__ import annotations

import pytest

from tests.property._support import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
