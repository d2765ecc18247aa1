"""What the property tests share: their sizes and a clock they move by hand."""

from __future__ import annotations

import os

from hypothesis import settings


def sized(examples: int = 60, steps: int = 40) -> settings:
    """Hypothesis settings sized by ``NBOS_PROPERTY_EXAMPLES`` and ``NBOS_PROPERTY_STEPS``.

    ``examples`` and ``steps`` are the defaults when a variable is unset (steps
    count only for stateful tests). No deadline: ``tests/conftest.py`` sets none for all.
    """
    return settings(
        max_examples=int(os.environ.get("NBOS_PROPERTY_EXAMPLES", str(examples))),
        stateful_step_count=int(os.environ.get("NBOS_PROPERTY_STEPS", str(steps))),
    )


class ManualClock:
    """A clock that moves only when the test says so: a real ``Callable[[], float]``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
