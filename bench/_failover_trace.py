"""Where each kill of ``bench/failover.py`` spent its time (``NBOS_BENCH_FAILOVER_TRACE=1``).

Not a benchmark itself. Timestamps come from three places, all on this machine's wall
clock: the bench (the kill, the cell's reply), the front's log records in this process
(the exit seen, the campaign's answer, the lost cell settled) and the replicas' log files
(a survivor campaigning, the new leader, an election timeout's campaign). The replicas'
log lines have millisecond precision.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

#: (step, pattern of a front log message); the first match after the kill counts.
_FRONT_STEPS = (
    ("exit seen", re.compile(r"replica (?P<node>\d+) is dead \(process exited")),
    ("campaign answered", re.compile(r"replica (?P<node>\d+) campaigns for the Raft")),
    ("settled", re.compile(r"cell \d+ settled as")),
)
#: (step, pattern of a replica's log line).
_REPLICA_STEPS = (
    ("campaign", re.compile(r"node (?P<node>\d+): leader \d+ is gone, campaigning at once")),
    ("no campaign", re.compile(r"node (?P<node>\d+): not campaigning for")),
    ("timeout campaign", re.compile(r"node (?P<node>\d+): election timeout")),
    ("leader", re.compile(r"node (?P<node>\d+): leader for term")),
)
_LINE = re.compile(r"^(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ nbos[\w.]*: (?P<msg>.*)$")
STEPS = (
    "exit seen",
    "campaign",
    "no campaign",
    "timeout campaign",
    "campaign answered",
    "leader",
    "settled",
    "reply",
    "ok",
)


@dataclass
class Kill:
    """One kill: its wall-clock time and each step's time after it (s)."""

    at: float
    victim: int
    steps: dict[str, float] = field(default_factory=dict)
    who: dict[str, int] = field(default_factory=dict)
    load: float = 0.0


class FrontRecords(logging.Handler):
    """Keeps the front's log records (message and time) of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))

    def install(self) -> None:
        nbos_log = logging.getLogger("nbos")
        nbos_log.setLevel(logging.INFO)
        nbos_log.addHandler(self)


def replica_lines(log_dir: Path) -> list[tuple[float, str]]:
    """Every nbos log line of the replicas' log files under ``log_dir``, with its time."""
    lines: list[tuple[float, str]] = []
    for path in log_dir.rglob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m is None:
                continue
            when = datetime.datetime.strptime(m["when"], "%Y-%m-%d %H:%M:%S,%f")
            lines.append((time.mktime(when.timetuple()) + when.microsecond / 1e6, m["msg"]))
    return lines


def assign(
    kills: list[Kill], front: list[tuple[float, str]], replicas: list[tuple[float, str]]
) -> None:
    """Give each kill the first time of each step between it and the next kill."""
    bounds = [k.at for k in kills[1:]] + [float("inf")]
    for kill, end in zip(kills, bounds, strict=True):
        for source, steps in ((front, _FRONT_STEPS), (replicas, _REPLICA_STEPS)):
            for when, msg in sorted(source):
                # replica lines are truncated to the millisecond: allow one before the kill
                if not kill.at - 0.001 <= when < end:
                    continue
                for step, pattern in steps:
                    m = pattern.search(msg)
                    if m is not None and step not in kill.steps:
                        kill.steps[step] = max(0.0, when - kill.at)
                        if "node" in m.groupdict():
                            kill.who[step] = int(m["node"])


def report(kills: list[Kill], slowest: int = 5) -> None:
    """Median and max of each step, and the slowest kills step by step."""
    print("per step, ms after the kill: p50 (max) [kills with the step]")
    for step in STEPS:
        times = sorted(k.steps[step] for k in kills if step in k.steps)
        if times:
            print(
                f"  {step:18} {times[len(times) // 2] * 1000:7.0f} ({times[-1] * 1000:5.0f})"
                f" [{len(times)}]"
            )
    print(f"the {slowest} slowest kills (to the first reply), ms after the kill:")
    for kill in sorted(kills, key=lambda k: -k.steps.get("reply", 0.0))[:slowest]:
        parts = [
            f"{step} {kill.steps[step] * 1000:.0f}"
            + (f" (r{kill.who[step]})" if step in kill.who else "")
            for step in STEPS
            if step in kill.steps
        ]
        print(f"  killed r{kill.victim}, load {kill.load:.1f}: " + ", ".join(parts))
