"""The fault schedule: which nemesis strikes when, drawn from one seed.

The schedule depends on nothing but the seed and the nemeses' names, so a seed
replays the same faults in the same order; how many of them a run gets through
depends on its duration and the machine's speed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import attrs

#: Workload cells between two faults.
CELLS_BETWEEN = (1, 3)
#: How far into the slow cell a fault strikes, in seconds.
STRIKE_AFTER_S = (0.1, 1.0)


@attrs.frozen
class PlannedFault:
    """Fault ``number`` (from 1): ``cells_before`` workload cells, then a slow cell, and
    ``nemesis`` strikes ``strike_after_s`` into it; ``seed`` seeds its own choices."""

    number: int
    nemesis: str
    cells_before: int
    strike_after_s: float
    seed: int


def plan_faults(seed: int, nemeses: Sequence[str]) -> Iterator[PlannedFault]:
    """The endless fault schedule of ``seed`` over the nemeses named ``nemeses``."""
    rng = random.Random(seed)
    for number in itertools.count(1):
        yield PlannedFault(
            number=number,
            nemesis=rng.choice(nemeses),
            cells_before=rng.randint(*CELLS_BETWEEN),
            strike_after_s=round(rng.uniform(*STRIKE_AFTER_S), 3),
            seed=rng.getrandbits(32),
        )
