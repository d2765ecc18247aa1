"""How fairly a run shared its GPUs among users: each user's GPU-hours against their fair share,
Jain's fairness index, and each user's p99 wait (``docs/simulator.md``, "Quotas and fair share").

A user's *fair share* is measured moment by moment: at every instant, the GPUs the
run's cells hold are divided among the users whose cells want GPUs then (ready, or
running) by weighted max-min fairness ("water-filling"), each user capped at what their
cells want, weights being the users' quotas (equal weights without quotas; users with a
quota of 0 share only what the others leave). Integrated over the run, the fair shares
sum to the GPU-hours used, so a user's ``used / fair`` above 1 got more than their
share while others waited, and below 1 less. A user who never competed has ``used ==
fair``. Jain's index ``(sum x)^2 / (n * sum x^2)`` over those ratios is 1 when every user
got exactly their share and falls towards ``1/n`` as one user takes everything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import attrs

from nbos.scaling.fair_share import FairShare
from nbos.scaling.trace import Trace


class UserCell(NamedTuple):
    """A started cell as its user's figures count it (times in trace seconds): ready to run
    (submitted and its kernel's previous cell ended), started on its GPUs, ended."""

    user: str
    gpus: int
    ready: float
    start: float
    end: float

    @property
    def wait(self) -> float:
        return max(0.0, self.start - self.ready)


@attrs.frozen
class UserFigures:
    """One user's share of a run (see the module's description of the fair share)."""

    user: str
    #: ``None``: the run had no quotas.
    quota: int | None
    cells: int
    gpu_hours: float
    fair_gpu_hours: float
    #: The 99th percentile of the user's cells' waits from ready to started (seconds).
    wait_p99: float


def user_figures(
    trace: Trace, cells: Sequence[UserCell], fair_share: FairShare | None
) -> tuple[UserFigures, ...]:
    """Each user of ``trace``'s sessions (and of ``cells``), by name."""
    names = sorted({s.owner for s in trace.sessions} | {c.user for c in cells})
    weights = {u: fair_share.quota(u) if fair_share is not None else 1 for u in names}
    fair = fair_gpu_seconds(cells, weights)
    by_user: dict[str, list[UserCell]] = {u: [] for u in names}
    for c in cells:
        by_user[c.user].append(c)
    figures = []
    for user, mine in by_user.items():
        figures.append(
            UserFigures(
                user=user,
                quota=None if fair_share is None else fair_share.quota(user),
                cells=len(mine),
                gpu_hours=sum(c.gpus * (c.end - c.start) for c in mine) / 3600,
                fair_gpu_hours=fair.get(user, 0.0) / 3600,
                wait_p99=percentile(sorted(c.wait for c in mine), 0.99),
            )
        )
    return tuple(figures)


def fair_gpu_seconds(cells: Iterable[UserCell], weights: Mapping[str, int]) -> dict[str, float]:
    """Each user's fair share of the GPU-seconds ``cells`` used: at every instant the GPUs
    held, water-filled over the users whose cells want GPUs then."""
    # (time, user, change of GPUs wanted, change of GPUs held)
    changes: list[tuple[float, str, int, int]] = []
    for c in cells:
        changes += [(c.ready, c.user, c.gpus, 0), (c.start, c.user, 0, c.gpus)]
        changes += [(c.end, c.user, -c.gpus, -c.gpus)]
    changes.sort(key=lambda e: e[0])
    wanted: dict[str, int] = {}
    held = wanted_total = 0
    fair: dict[str, float] = {}
    previous = changes[0][0] if changes else 0.0
    for when, user, want, hold in changes:
        if when > previous and held:
            # Uncontended (the usual case): every user's share is what they want.
            shares = wanted if held >= wanted_total else water_fill(held, wanted, weights)
            for u, gpus in shares.items():
                fair[u] = fair.get(u, 0.0) + gpus * (when - previous)
        previous = when
        wanted[user] = wanted.get(user, 0) + want
        wanted_total += want
        if not wanted[user]:
            del wanted[user]
        held += hold
    return fair


def water_fill(
    total: float, wanted: Mapping[str, int], weights: Mapping[str, int]
) -> dict[str, float]:
    """``total`` GPUs divided by weighted max-min fairness among ``wanted`` (user -> GPUs
    wanted), no user above what they want; users of weight 0 share what is left equally."""
    shares = dict.fromkeys(wanted, 0.0)
    weighted = {u: float(weights.get(u, 1)) for u in wanted if weights.get(u, 1) > 0}
    left = _fill(total, wanted, weighted, shares)
    _fill(left, wanted, {u: 1.0 for u in wanted if u not in weighted}, shares)
    return shares


def _fill(
    total: float, wanted: Mapping[str, int], weights: dict[str, float], shares: dict[str, float]
) -> float:
    """Water-fill ``total`` over the users of ``weights`` into ``shares``; return what is left."""
    active = {u: w for u, w in weights.items() if wanted[u] > 0}
    while active and total > 1e-12:
        per_weight = total / sum(active.values())
        capped = {u for u, w in active.items() if wanted[u] - shares[u] <= per_weight * w}
        if not capped:
            for u, w in active.items():
                shares[u] += per_weight * w
            return 0.0
        for u in capped:
            total -= wanted[u] - shares[u]
            shares[u] = float(wanted[u])
            del active[u]
    return max(total, 0.0)


def jain_index(shares: Sequence[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of ``shares``: 1 when all are equal,
    ``1/n`` when one holds everything; 1 for none (or all zero)."""
    square_sum = sum(x * x for x in shares)
    if not shares or square_sum == 0:
        return 1.0
    return sum(shares) ** 2 / (len(shares) * square_sum)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of sorted values; 0 for no values."""
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
