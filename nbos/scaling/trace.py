"""Session traces for the simulator: the types, a loader for JSON and CSV files, and a generator.

A trace is a list of notebook sessions; each has a start and stop time (seconds),
the GPUs its kernel asks for, and the cells it submitted (submit time, run
time, and optionally fewer GPUs than the session's). The file formats are in
``docs/simulator.md``. :func:`synthetic_trace` draws sessions with long think
times between short GPU bursts, calibrated on the summary of the Adobe trace
that the NotebookOS paper used (59 sessions, 48 h, 5,070 GPU-hours reserved,
1,304 busy: about 26 %).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from nbos.core.errors import ScalingError

log = logging.getLogger(__name__)


class Cell(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cell execution: submitted at ``start``, runs ``duration`` s on ``gpus`` GPUs
    (``None``: the session's count)."""

    start: float
    duration: float
    gpus: int | None = None


class Session(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One notebook session (one kernel); ``user`` owns it (``None``: a user of its own,
    named as the session)."""

    id: str
    start: float
    stop: float
    gpus: int
    cells: tuple[Cell, ...] = ()
    user: str | None = None

    def cell_gpus(self, cell: Cell) -> int:
        return self.gpus if cell.gpus is None else cell.gpus

    @property
    def owner(self) -> str:
        """The session's user: its ``user``, else its id."""
        return self.id if self.user is None else self.user


class Trace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sessions, in the order given; build through :func:`validated` to check them."""

    sessions: tuple[Session, ...]

    @property
    def end(self) -> float:
        return max((s.stop for s in self.sessions), default=0.0)

    @property
    def names_users(self) -> bool:
        """Whether any session names its user (else each session is a user of its own)."""
        return any(s.user is not None for s in self.sessions)

    def gpu_hours_reserved(self) -> float:
        """GPU-hours the sessions would hold if each reserved its GPUs for its lifetime."""
        return sum(s.gpus * (s.stop - s.start) for s in self.sessions) / 3600

    def gpu_hours_busy(self) -> float:
        """GPU-hours the cells keep GPUs busy."""
        return sum(s.cell_gpus(c) * c.duration for s in self.sessions for c in s.cells) / 3600


def first_hours(trace: Trace, hours: float) -> Trace:
    """The part of ``trace`` in its first ``hours``: sessions that start by then, with the
    cells they submit by then, each cut to end by then, stopping then at the latest (a stop
    with cells still queued still waits for them, as always).

    Cut, a cell holds its GPUs only within the window, so a simulation and a live replay
    of it (which gives up what runs past its end) account for the same work."""
    if not hours >= 0:
        raise _bad(f"cannot cut a trace to {hours} hours")
    end = hours * 3600
    return Trace(
        tuple(
            msgspec.structs.replace(
                s,
                stop=min(s.stop, end),
                cells=tuple(
                    msgspec.structs.replace(c, duration=min(c.duration, end - c.start))
                    for c in s.cells
                    if c.start <= end
                ),
            )
            for s in trace.sessions
            if s.start <= end
        )
    )


def with_users(trace: Trace, users: Mapping[str, str]) -> Trace:
    """``trace`` with each session named in ``users`` (session id -> user) owned by that user.

    Raises :class:`ScalingError` for a session id the trace does not hold or a user name
    that is not a non-empty string.
    """
    known = {s.id for s in trace.sessions}
    unknown = sorted(set(users) - known)
    if unknown:
        raise _bad(f"user mapping names sessions the trace does not hold: {unknown}")
    bad = sorted(sid for sid, user in users.items() if not isinstance(user, str) or not user)
    if bad:
        raise _bad(f"user mapping: sessions {bad} need a non-empty user name")
    return Trace(
        tuple(
            msgspec.structs.replace(s, user=users[s.id]) if s.id in users else s
            for s in trace.sessions
        )
    )


def validated(trace: Trace) -> Trace:
    """``trace`` with each session's cells sorted by submit time, or :class:`ScalingError`.

    Checks: unique session ids; a session's ``user``, if given, not empty; finite
    times; ``0 <= start <= stop``; ``gpus >= 0``; every cell submitted within
    ``[start, stop]`` with ``duration >= 0`` and ``0 <= gpus <= `` the session's.
    Cells may overlap: a kernel runs them one after another, as Jupyter queues them.
    """
    seen: set[str] = set()
    for s in trace.sessions:
        if s.id in seen:
            raise _bad(f"session {s.id!r} appears twice")
        seen.add(s.id)
        _check_session(s)
    return Trace(
        tuple(
            msgspec.structs.replace(s, cells=tuple(sorted(s.cells, key=lambda c: c.start)))
            for s in trace.sessions
        )
    )


def _check_session(s: Session) -> None:
    if s.user is not None and not s.user:
        raise _bad(f"session {s.id!r}: an empty user name (leave it out for a user of its own)")
    if not (math.isfinite(s.start) and math.isfinite(s.stop) and 0 <= s.start <= s.stop):
        raise _bad(f"session {s.id!r}: start {s.start} and stop {s.stop} need 0 <= start <= stop")
    if s.gpus < 0:
        raise _bad(f"session {s.id!r}: gpus {s.gpus} < 0")
    for c in s.cells:
        if not (math.isfinite(c.start) and s.start <= c.start <= s.stop):
            raise _bad(f"session {s.id!r}: cell at {c.start} outside [{s.start}, {s.stop}]")
        if not (math.isfinite(c.duration) and c.duration >= 0):
            raise _bad(f"session {s.id!r}: cell at {c.start} has duration {c.duration}")
        if not 0 <= s.cell_gpus(c) <= s.gpus:
            raise _bad(
                f"session {s.id!r}: cell at {c.start} asks for {c.gpus} GPUs "
                f"(the session has {s.gpus})"
            )


# --- files ---------------------------------------------------------------------------

CSV_FIELDS = ("session", "event", "time", "duration", "gpus")
#: An optional column of the CSV form: the session's user, on its ``start`` row.
CSV_USER = "user"
#: The columns of a task-level trace (the Tiresias scheduler's format) that the importer reads.
TASK_FIELDS = ("job_id", "num_gpu", "submit_time", "duration")


def load_trace(path: str | Path) -> Trace:
    """Read a ``.json`` or ``.csv`` trace (format by suffix) and validate it.

    Raises :class:`ScalingError` naming the file for unreadable or malformed input.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _bad(f"cannot read trace {path}: {exc}") from exc
    if path.suffix.lower() == ".json":
        return parse_json(data, str(path))
    if path.suffix.lower() == ".csv":
        text = data.decode("utf-8", errors="replace")
        if is_task_csv(text):
            return parse_task_csv(text, str(path))
        return parse_csv(text, str(path))
    raise _bad(f"trace {path}: unknown format {path.suffix!r} (expected .json or .csv)")


def is_task_csv(text: str) -> bool:
    """Whether ``text`` is a task-level trace (its header names the Tiresias task columns)."""
    header = next(csv.reader(io.StringIO(text.partition("\n")[0])), [])
    return set(TASK_FIELDS) <= {name.strip() for name in header}


def parse_json(data: bytes | str, source: str = "<json>") -> Trace:
    """A trace from JSON ``{"sessions": [{"id", "start", "stop", "gpus", "cells": [...]}]}``."""
    try:
        trace = msgspec.json.decode(data, type=Trace, strict=False)
    except msgspec.ValidationError as exc:
        raise _bad(f"trace {source}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise _bad(f"trace {source}: not JSON ({exc})") from exc
    return _validated_from(trace, source)


def dump_json(trace: Trace) -> bytes:
    """The JSON form :func:`parse_json` reads."""
    return msgspec.json.encode(trace)


def parse_csv(text: str, source: str = "<csv>") -> Trace:
    """A trace from CSV rows ``session,event,time,duration,gpus`` (header required).

    ``event`` is ``start`` (``gpus`` required), ``stop``, or ``cell`` (``duration``
    required, ``gpus`` optional). Each session needs exactly one start and one stop.
    An optional ``user`` column names the session's user on its ``start`` row.
    """
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or not set(CSV_FIELDS) <= set(reader.fieldnames):
        raise _bad(f"trace {source}: header must name {', '.join(CSV_FIELDS)}")
    starts: dict[str, tuple[float, int]] = {}
    stops: dict[str, float] = {}
    cells: defaultdict[str, list[Cell]] = defaultdict(list)
    users: dict[str, str] = {}
    for line, row in enumerate(reader, start=2):
        _csv_row(row, starts, stops, cells, f"trace {source} line {line}")
        user = (row.get(CSV_USER) or "").strip()
        if user and (row.get("event") or "").strip() == "start":
            users[(row.get("session") or "").strip()] = user
    missing = sorted((set(starts) ^ set(stops)) | (set(cells) - set(starts)))
    if missing:
        raise _bad(f"trace {source}: sessions without both a start and a stop: {missing}")
    sessions = (
        Session(sid, start, stops[sid], gpus, tuple(cells[sid]), users.get(sid))
        for sid, (start, gpus) in starts.items()
    )
    return _validated_from(Trace(tuple(sessions)), source)


def dump_csv(trace: Trace) -> str:
    """The CSV form :func:`parse_csv` reads (with a ``user`` column if a session names one)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    named = trace.names_users
    user: tuple[str, ...] = (CSV_USER,) if named else ()
    writer.writerow((*CSV_FIELDS, *user))
    for s in trace.sessions:
        if named:
            user = (s.user or "",)
        writer.writerow((s.id, "start", s.start, "", s.gpus, *user))
        for c in s.cells:
            gpus = "" if c.gpus is None else c.gpus
            writer.writerow((s.id, "cell", c.start, c.duration, gpus, *("",) * len(user)))
        writer.writerow((s.id, "stop", s.stop, "", "", *("",) * len(user)))
    return out.getvalue()


def parse_task_csv(text: str, source: str = "<tasks>") -> Trace:
    """Sessions from a task-level trace: rows ``job_id,num_gpu,submit_time,duration`` (minutes).

    The session rule (``docs/simulator.md``, "Task-level traces"): the tasks of one
    session are consecutive rows with non-decreasing ``submit_time``; a row whose
    ``submit_time`` goes backwards starts a new session. A session starts at its
    first task's submission and stops when its last task ends as the trace ran it
    (the latest ``submit_time + duration``), holding a reservation of its largest
    task's GPUs for that whole time. Each task is a cell of ``num_gpu`` GPUs.
    """
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or not set(TASK_FIELDS) <= set(reader.fieldnames):
        raise _bad(f"trace {source}: header must name {', '.join(TASK_FIELDS)}")
    groups: list[list[Cell]] = []
    previous = math.inf
    for line, row in enumerate(reader, start=2):
        where = f"trace {source} line {line}"
        submit = _number(row, "submit_time", where) * 60
        cell = Cell(submit, _number(row, "duration", where) * 60, _integer(row, "num_gpu", where))
        if submit < previous:
            groups.append([])
        groups[-1].append(cell)
        previous = submit
    return _validated_from(Trace(tuple(_task_session(i, g) for i, g in enumerate(groups))), source)


def _task_session(index: int, cells: list[Cell]) -> Session:
    stop = max(c.start + c.duration for c in cells)
    gpus = max(c.gpus or 0 for c in cells)
    return Session(f"task-session-{index:04d}", cells[0].start, stop, gpus, tuple(cells))


def _csv_row(
    row: dict[str, str | None],
    starts: dict[str, tuple[float, int]],
    stops: dict[str, float],
    cells: defaultdict[str, list[Cell]],
    where: str,
) -> None:
    sid, event = (row.get("session") or "").strip(), (row.get("event") or "").strip()
    if not sid:
        raise _bad(f"{where}: no session id")
    time = _number(row, "time", where)
    if event == "start":
        if sid in starts:
            raise _bad(f"{where}: second start for session {sid!r}")
        starts[sid] = (time, _integer(row, "gpus", where))
    elif event == "stop":
        if sid in stops:
            raise _bad(f"{where}: second stop for session {sid!r}")
        stops[sid] = time
    elif event == "cell":
        gpus = _integer(row, "gpus", where) if (row.get("gpus") or "").strip() else None
        cells[sid].append(Cell(time, _number(row, "duration", where), gpus))
    else:
        raise _bad(f"{where}: event {event!r} is not start, stop or cell")


def _number(row: dict[str, str | None], key: str, where: str) -> float:
    try:
        value = float((row.get(key) or "").strip())
    except ValueError:
        raise _bad(f"{where}: {key} {row.get(key)!r} is not a number") from None
    if not math.isfinite(value):
        raise _bad(f"{where}: {key} {value} is not finite")
    return value


def _integer(row: dict[str, str | None], key: str, where: str) -> int:
    try:
        return int((row.get(key) or "").strip())
    except ValueError:
        raise _bad(f"{where}: {key} {row.get(key)!r} is not an integer") from None


def _validated_from(trace: Trace, source: str) -> Trace:
    try:
        return validated(trace)
    except ScalingError as exc:
        raise ScalingError(f"trace {source}: {exc}") from exc


# --- synthetic -----------------------------------------------------------------------

#: GPUs per session and their weights (mean 2.6 GPUs).
DEFAULT_GPU_MIX: tuple[tuple[int, float], ...] = ((1, 0.4), (2, 0.3), (4, 0.2), (8, 0.1))


def synthetic_trace(
    sessions: int = 59,
    hours: float = 48.0,
    seed: int = 0,
    *,
    mean_cell_minutes: float = 5.0,
    mean_think_minutes: float = 14.2,
    gpu_mix: Sequence[tuple[int, float]] = DEFAULT_GPU_MIX,
) -> Trace:
    """Sessions with long idle think times between short GPU bursts, reproducible per ``seed``.

    Sessions start in the first 30 % of the window and last 50-95 % of it (cut at
    its end). Within a session, cells run a log-normal time (mean
    ``mean_cell_minutes``, sigma 1) and the user thinks an exponential time (mean
    ``mean_think_minutes``) after each. With the defaults, 59 sessions over 48 h
    reserve about 5,000 GPU-hours and keep GPUs busy about 26 % of that, as in the
    paper's Adobe trace summary. Raises :class:`ScalingError` for non-positive sizes.
    """
    if sessions < 0 or not hours > 0 or not mean_cell_minutes > 0 or not mean_think_minutes > 0:
        raise _bad(
            f"synthetic trace needs sessions >= 0 and positive times; got sessions={sessions}, "
            f"hours={hours}, cell={mean_cell_minutes}, think={mean_think_minutes}"
        )
    if not gpu_mix or any(g < 0 or w < 0 for g, w in gpu_mix) or sum(w for _, w in gpu_mix) <= 0:
        raise _bad(f"synthetic trace: bad gpu_mix {list(gpu_mix)}")
    rng = random.Random(seed)
    window = hours * 3600
    counts, weights = zip(*gpu_mix, strict=True)
    drawn = []
    for i in range(sessions):
        gpus = rng.choices(counts, weights)[0]
        drawn.append(
            _synthetic_session(
                f"s{i:03d}", rng, window, gpus,
                mean_cell=mean_cell_minutes * 60, mean_think=mean_think_minutes * 60,
            )
        )  # fmt: skip
    return Trace(tuple(drawn))


def _synthetic_session(
    sid: str, rng: random.Random, window: float, gpus: int, *, mean_cell: float, mean_think: float
) -> Session:
    start = rng.uniform(0, 0.3 * window)
    stop = min(window, start + rng.uniform(0.5, 0.95) * window)
    # A log-normal with sigma 1 has mean exp(mu + 1/2).
    mu = math.log(mean_cell) - 0.5
    cells: list[Cell] = []
    t = start + rng.expovariate(1 / mean_think)
    while True:
        duration = rng.lognormvariate(mu, 1.0)
        if t + duration > stop:
            break
        cells.append(Cell(round(t, 3), round(duration, 3)))
        t += duration + rng.expovariate(1 / mean_think)
    return Session(sid, round(start, 3), round(stop, 3), gpus, tuple(cells))


def _bad(message: str) -> ScalingError:
    log.warning("%s", message)
    return ScalingError(message)
