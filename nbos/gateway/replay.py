"""Replaying a session trace on a live cluster, through a gateway's control API.

:func:`replay` starts one kernel per session (``StartKernel(gpus)``, retried while the
cluster cannot place it), runs its cells in order through a Jupyter client, each at
its submit time divided by ``speedup`` (or once the session's previous cell ended),
as ``%%gpus N`` then a sleep of its duration divided by ``speedup``, so it holds its
GPUs that long, and shuts the kernel down at its stop time. Then it reads the
gateway's own accounting (``UsageRequest``: when each cell got and gave back its
GPUs, the hosts over time, the moves and scaling actions) and turns it into the
:class:`~nbos.scaling.SimResult` that ``nbos simulate`` prints, in trace seconds
(real seconds times ``speedup``). ``docs/simulator.md`` says where the two differ.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import anyio
import attrs
import msgspec
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.connect import KernelConnectionInfo

from nbos.core.errors import ConfigError, TransportError
from nbos.gateway._kernel_manager import HOST_WAIT_S
from nbos.gateway.control_api import (
    ControlError,
    KernelInfo,
    ShutdownKernel,
    StartKernel,
    Usage,
    UsageRequest,
    call,
)
from nbos.scaling.delays import DelaySplit, carried_over, delay_at_1x
from nbos.scaling.fair_share import FairShare
from nbos.scaling.fairness import UserCell
from nbos.scaling.ledger import CellUsage, HostCount
from nbos.scaling.results import Run, Sample, SimResult, sim_result
from nbos.scaling.trace import Cell, Session, Trace

log = logging.getLogger(__name__)

#: How long one cell may take beyond its scaled duration before it is given up (real s).
_CELL_SLACK_S = 600.0
_CONTROL_TIMEOUT_S = 120.0
#: The overrun limit is never shorter than this in real seconds: kernel starts and each
#: cell's own overhead take real time that no speed-up shortens.
_OVERRUN_FLOOR_S = 300.0


@attrs.frozen
class ReplayConfig:
    """How a trace is replayed: ``speedup`` trace seconds per real second; a placement
    refused is retried every ``retry`` trace seconds; ``overrun_limit`` trace seconds after
    the trace's end, cells not started are given up (as ``SimConfig.overrun_limit``);
    ``interactive_within`` as in ``SimConfig`` (the overrun lasts at least
    :data:`_OVERRUN_FLOOR_S` real seconds); ``policy`` only labels the result, and
    ``fair_share`` only frames the users' fair shares in it (the gateway keeps to the
    quotas of its own users)."""

    speedup: float = 60.0
    retry: float = 60.0
    overrun_limit: float = 6 * 3600.0
    interactive_within: float = 1.0
    policy: str = ""
    fair_share: FairShare | None = None

    def __attrs_post_init__(self) -> None:
        for key in ("speedup", "retry"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(key, value, "a positive number")
        for key in ("overrun_limit", "interactive_within"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(key, value, "a number >= 0")


@attrs.define
class ReplayRun:
    """One replay: the gateway's accounting at its start and end, the real times it
    began and ended, each session's kernel id, and the cells sent and answered so far."""

    before: Usage
    t0: float
    after: Usage | None = None
    ended: float = 0.0
    kernels: dict[str, str] = attrs.Factory(dict)
    #: When each cell's request was sent (real seconds), by session id and cell number.
    sent: dict[tuple[str, int], float] = attrs.Factory(dict)
    cells_sent: int = 0
    cells_done: int = 0


@attrs.frozen
class ReplayProgress:
    """Where a replay is: trace seconds replayed of ``trace_end``, cells sent (their
    request went to the kernel) and answered of ``cells``, kernels running."""

    trace_time: float
    trace_end: float
    cells_sent: int
    cells_done: int
    cells: int
    kernels: int

    def line(self) -> str:
        return (
            f"replay: {self.trace_time / 3600:.2f} of {self.trace_end / 3600:.2f} trace hours, "
            f"cells {self.cells_done} done, {self.cells_sent - self.cells_done} running "
            f"of {self.cells}, {self.kernels} kernels"
        )


@attrs.frozen
class ReplayWatch:
    """Who hears of a replay as it goes: ``note`` gets each thing the kernels said about
    a cell (nbos's waiting-for-GPUs lines, a cell's output), one line each, prefixed with
    its session; ``progress`` a :class:`ReplayProgress` every ``every`` real seconds."""

    note: Callable[[str], None] | None = None
    progress: Callable[[ReplayProgress], None] | None = None
    every: float = 30.0


async def replay(
    trace: Trace, address: str, config: ReplayConfig, watch: ReplayWatch | None = None
) -> SimResult:
    """Replay ``trace`` on the gateway whose control endpoint is ``address``, telling
    ``watch`` (else the log, at INFO) how it goes.

    Raises :class:`TransportError` when the gateway does not answer.
    """
    watch = watch or ReplayWatch()
    run = ReplayRun(await _usage(address), time.time())
    limit = trace.end / config.speedup + max(
        config.overrun_limit / config.speedup, _OVERRUN_FLOOR_S
    )
    with anyio.move_on_after(limit):
        async with anyio.create_task_group() as tg:
            if watch.progress is not None:
                tg.start_soon(_report_progress, watch.progress, watch.every, trace, config, run)
            async with anyio.create_task_group() as sessions:
                for session in trace.sessions:
                    sessions.start_soon(_session, session, address, config, run, watch.note)
            tg.cancel_scope.cancel()
    run.ended = time.time()
    run.after = await _usage(address)
    return result(trace, run, config)


async def _usage(address: str) -> Usage:
    reply = await call(address, UsageRequest(), timeout=_CONTROL_TIMEOUT_S)
    if not isinstance(reply, Usage):
        raise TransportError(f"the gateway at {address} answered UsageRequest with {reply!r}")
    return reply


async def _at(t0: float, trace_time: float, speedup: float) -> None:
    await anyio.sleep(max(0.0, t0 + trace_time / speedup - time.time()))


async def _report_progress(
    progress: Callable[[ReplayProgress], None],
    every: float,
    trace: Trace,
    config: ReplayConfig,
    run: ReplayRun,
) -> None:
    cells = sum(len(s.cells) for s in trace.sessions)
    while True:
        await anyio.sleep(every)
        progress(
            ReplayProgress(
                min(trace.end, (time.time() - run.t0) * config.speedup),
                trace.end,
                run.cells_sent,
                run.cells_done,
                cells,
                len(run.kernels),
            )
        )


async def _session(
    session: Session,
    address: str,
    config: ReplayConfig,
    run: ReplayRun,
    note: Callable[[str], None] | None,
) -> None:
    t0 = run.t0
    await _at(t0, session.start, config.speedup)
    info = await _start(session, address, config, t0)
    if info is None:
        log.warning("session %s: never placed before it stopped", session.id)
        return
    run.kernels[session.id] = info.kernel_id
    try:
        client = AsyncKernelClient()
        client.load_connection_info(cast(KernelConnectionInfo, dict(info.connection)))
        client.start_channels()
        try:
            for i, cell in enumerate(session.cells, start=1):
                await _at(t0, cell.start, config.speedup)
                run.sent[(session.id, i)] = time.time()
                run.cells_sent += 1
                said = _Lines(f"session {session.id} cell {i}", note)
                await _cell(client, session, cell, config.speedup, said)
                run.cells_done += 1
        finally:
            client.stop_channels()
        await _at(t0, session.stop, config.speedup)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CONTROL_TIMEOUT_S):
            await call(address, ShutdownKernel(info.kernel_id), timeout=_CONTROL_TIMEOUT_S)


async def _start(
    session: Session, address: str, config: ReplayConfig, t0: float
) -> KernelInfo | None:
    """The session's kernel, asked for until the cluster places it or the session stops."""
    while True:
        # The session's user owns its kernel, so the gateway's quotas count its cells.
        start = StartKernel(gpus=session.gpus, user=session.user)
        # A start may wait for a host the autoscaler adds before it starts.
        reply = await call(address, start, timeout=_CONTROL_TIMEOUT_S + HOST_WAIT_S)
        if isinstance(reply, KernelInfo):
            return reply
        log.info(
            "session %s: %s",
            session.id,
            reply.message if isinstance(reply, ControlError) else reply,
        )
        if time.time() - t0 >= session.stop / config.speedup:
            return None
        await anyio.sleep(config.retry / config.speedup)


@attrs.frozen
class _Lines:
    """A cell's output as lines of their own, each after ``prefix``: to ``note``, else the
    log (not the process's stdout, where a client would print it, lines run together)."""

    prefix: str
    note: Callable[[str], None] | None

    def __call__(self, message: dict[str, Any]) -> None:
        content = message["content"]
        match message["msg_type"]:
            case "stream":
                text = content.get("text", "")
            case "display_data" | "update_display_data" | "execute_result":
                text = content.get("data", {}).get("text/plain", "")
            case "error":
                text = f"{content.get('ename', '')}: {content.get('evalue', '')}"
            case _:
                return
        for line in str(text).splitlines():
            if line.strip():
                self._say(f"{self.prefix}: {line.strip()}")

    def _say(self, line: str) -> None:
        if self.note is not None:
            self.note(line)
        else:
            log.info("%s", line)


async def _cell(
    client: AsyncKernelClient, session: Session, cell: Cell, speedup: float, said: _Lines
) -> None:
    gpus = session.cell_gpus(cell)
    code = f"import time\ntime.sleep({cell.duration / speedup!r})"
    if gpus:
        code = f"%%gpus {gpus}\n{code}"
    reply = await client.execute_interactive(
        code,
        timeout=cell.duration / speedup + _CELL_SLACK_S,
        store_history=False,
        output_hook=said,
    )
    if reply["content"].get("status") != "ok":
        log.warning("session %s: a cell ended %s", session.id, reply["content"].get("status"))


# --- the gateway's accounting as simulator metrics ------------------------------------


def result(trace: Trace, run: ReplayRun, config: ReplayConfig) -> SimResult:
    """The metrics of ``nbos simulate`` from the gateway's ledger over ``run`` (its totals
    at the end less those at the start), in trace seconds."""
    assert run.after is not None
    after, t0, ended, k = run.after, run.t0, run.ended, config.speedup
    cells = _cells(trace, run, k)
    samples = _samples(cells.used, after.hosts, t0, ended, k)
    measured = Run(
        mode="replay",
        policy=config.policy,
        interactive_within=config.interactive_within,
        seconds=(ended - t0) * k,
        totals=(after.totals - run.before.totals).scaled(k),
        delays=cells.delays,
        busy_gpu_s=cells.busy,
        peak_gpus_committed=max((s.gpus_committed for s in samples), default=0),
        hosts_timeline=tuple(((h.time - t0) * k, h.hosts) for h in _within(after.hosts, t0, ended)),
        samples=samples,
        user_cells=cells.by_user,
        fair_share=config.fair_share,
        speedup=k,
        overheads=cells.overheads,
        splits=cells.splits,
        delays_1x=cells.delays_1x,
    )
    return sim_result(trace, measured)


@attrs.define
class _CellFigures:
    """What :func:`_cells` finds (see there)."""

    delays: list[float] = attrs.Factory(list)
    overheads: list[float] = attrs.Factory(list)
    splits: list[DelaySplit] = attrs.Factory(list)
    delays_1x: list[float] = attrs.Factory(list)
    busy: float = 0.0
    used: list[CellUsage] = attrs.Factory(list)
    by_user: list[UserCell] = attrs.Factory(list)


def _cells(trace: Trace, run: ReplayRun, k: float) -> _CellFigures:
    """Each trace cell that got its GPUs: its delay (trace seconds) against the start it
    would have had on an unlimited cluster, the replay's own share of that delay (real
    seconds from the cell's due time to its GPU request reaching the gateway's scheduler,
    the rest being the wait for GPUs), the work (GPU-seconds) of all, their grants, and
    each as its session's user's.

    A cell's work is its duration, or the time it held its GPUs if shorter (the run ended
    while it ran, or it ended early): never more than what was reserved for it.
    """
    assert run.after is not None
    # A kernel's records in index order are its cells in order: a cell retried under a new
    # index (its claim lost) keeps one record, and an index refused before it was asked
    # for goes to the next cell.
    by_kernel: dict[str, list[CellUsage]] = {}
    for c in sorted(run.after.cells, key=lambda c: c.exec_index):
        by_kernel.setdefault(c.kernel_id, []).append(c)
    found = _CellFigures()
    for session in trace.sessions:
        kernel = run.kernels.get(session.id)
        records = by_kernel.get(kernel, []) if kernel is not None else []
        ideal_end = -math.inf
        before: CellUsage | None = None
        # The previous cell's delay and its delay at 1x (None: it did not start).
        carry: tuple[float, float] | None = None
        for i, cell in enumerate(session.cells, start=1):
            ideal = max(cell.start, ideal_end)
            previous_end, ideal_end = ideal_end, ideal + cell.duration
            usage = records[i - 1] if i <= len(records) else None
            earlier, before = before, usage
            carried, carry = carry, None
            if usage is None or usage.started is None:
                continue
            sent = run.sent.get((session.id, i), usage.ready)
            split = _split(usage, run.t0 + ideal / k, sent, earlier).scaled(k)
            late = late_1x = 0.0
            if carried is not None:
                late = carried_over(previous_end, carried[0], ideal)
                late_1x = carried_over(previous_end, carried[1], ideal)
            # Waiting behind the previous cell is what its delay carried over; the rest of
            # that wait (it held its GPUs past its duration, its reply) is nbos's own.
            queue = min(split.queue, late)
            split = msgspec.structs.replace(
                split, queue=queue, overhead=split.overhead + split.queue - queue
            )
            found.splits.append(split)
            at_1x = delay_at_1x(split, k, late_1x)
            # Real clocks jitter: a cell is never early.
            delay = max(0.0, (usage.started - run.t0) * k - ideal)
            found.delays.append(delay)
            found.delays_1x.append(at_1x)
            carry = (delay, at_1x)
            due = run.t0 + ideal / k
            found.overheads.append(min(delay / k, max(0.0, usage.ready - due)))
            gpus = session.cell_gpus(cell)
            held = (usage.ended if usage.ended is not None else run.ended) - usage.started
            found.busy += gpus * min(cell.duration, max(0.0, held) * k)
            found.used.append(usage)
            start = (usage.started - run.t0) * k
            end = (usage.ended - run.t0) * k if usage.ended is not None else start + cell.duration
            ready = min((usage.ready - run.t0) * k, start)
            found.by_user.append(UserCell(session.owner, gpus, ready, start, end))
    return found


def _split(usage: CellUsage, due: float, sent: float, earlier: CellUsage | None) -> DelaySplit:
    """Where a replayed cell's delay went, in real seconds: from its due time to its request
    being sent, waiting behind its session's previous cell while that ran (``queue``) and the
    rest (that cell's reply, or for a session's first cell its kernel's start) nbos's own;
    the request's way to the front nbos's own; from there the gateway's split
    (:meth:`CellUsage.split`)."""
    late = max(0.0, sent - due)
    ran_until = earlier.ended if earlier is not None and earlier.ended is not None else due
    behind = min(late, max(0.0, min(ran_until, sent) - due))
    arrived = usage.arrived if usage.arrived is not None else sent
    own = DelaySplit(queue=behind, overhead=late - behind + max(0.0, arrived - sent))
    gateway = usage.split()
    return own + gateway if gateway is not None else own


def _within(hosts: Sequence[HostCount], t0: float, end: float) -> list[HostCount]:
    """The host counts in force from ``t0`` to ``end``, the first moved to ``t0``."""
    first = max((h for h in hosts if h.time <= t0), key=lambda h: h.time, default=None)
    inside = [h for h in hosts if t0 < h.time <= end]
    if first is not None:
        inside.insert(0, HostCount(t0, first.hosts, first.gpus))
    return inside


def _samples(
    cells: Iterable[CellUsage], hosts: Sequence[HostCount], t0: float, end: float, k: float
) -> tuple[Sample, ...]:
    """The cluster at every change: GPUs committed (= busy: cells hold them while they
    run), provisioned, and hosts, in trace seconds."""
    events: list[tuple[float, int, HostCount | None]] = []
    for c in cells:
        assert c.started is not None
        events.append((c.started, c.gpus, None))
        events.append((c.ended if c.ended is not None else end, -c.gpus, None))
    events += [(h.time, 0, h) for h in _within(hosts, t0, end)]
    events.sort(key=lambda e: (e[0], e[1]))
    committed, current = 0, HostCount(t0, 0, 0)
    out = []
    for when, delta, count in events:
        committed += delta
        current = count if count is not None else current
        out.append(Sample((when - t0) * k, committed, committed, current.gpus, current.hosts))
    return tuple(out)
