"""Fixtures for the GPU accounting tests."""

from __future__ import annotations

import pytest


class ManualClock:
    """A clock that moves only when told: a real ``Callable[[], float]``, driven by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
