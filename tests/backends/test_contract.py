"""The ComputeBackend / ProcessHandle contract, run against every backend with real processes.

Exit statuses are normalised like ``subprocess``: a process killed by signal N
reports ``-N`` on every backend (Docker's ``128 + N`` included).
"""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from nbos.core.compute_backend import ComputeBackend, ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError, HostUnreachableError
from nbos.core.ids import HostId
from tests.backends._procs import (
    EXIT_3,
    FAMILY,
    SLEEP,
    TERM_EXITS_0,
    TERM_IGNORED,
    TICKER,
    WRITE_ENV,
    holds_within,
    marked_pids,
    python,
    read_counter,
    wait_for_file,
    wait_until_no_marked,
)
from tests.backends.conftest import HOSTS, Case

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_implements_the_protocols(case: Case) -> None:
    assert isinstance(case.backend, ComputeBackend)
    assert case.backend.name == case.kind
    assert tuple(case.backend.hosts()) == HOSTS
    handle = await case.start(python(EXIT_3))
    assert isinstance(handle, ProcessHandle)
    assert handle.host == case.host


async def test_wait_returns_the_exit_status(case: Case) -> None:
    handle = await case.start(python(EXIT_3))
    assert await handle.wait() == 3
    assert handle.returncode == 3
    assert await handle.wait() == 3  # again, once ended


async def test_environment_and_host_id_reach_the_process(case: Case) -> None:
    out = case.workdir / "env.txt"
    handle = await case.start(python(WRITE_ENV, out), host=HOSTS[1], FOO="bar baz")
    assert await handle.wait() == 0
    assert out.read_text() == f"bar baz {HOSTS[1]}"


async def test_sigkill_reports_minus_nine(case: Case) -> None:
    handle = await case.start(python(SLEEP))
    assert handle.returncode is None
    await handle.signal(signal.SIGKILL)
    with anyio.fail_after(10):
        assert await handle.wait() == -signal.SIGKILL
    assert handle.returncode == -signal.SIGKILL


async def test_a_signal_reaches_the_whole_process_tree(case: Case) -> None:
    ready = case.workdir / "child.pid"
    handle = await case.start(python(FAMILY, ready))
    await wait_for_file(ready)
    # The process and its child. Polled: once under load, a look right after the child
    # wrote its pid found only one of them.
    assert await holds_within(lambda: len(marked_pids(case.marker)) >= 2)
    await handle.signal(signal.SIGKILL)
    assert await handle.wait() == -signal.SIGKILL
    assert await wait_until_no_marked(case.marker) == []


async def test_sigstop_freezes_and_sigcont_resumes(case: Case) -> None:
    counter = case.workdir / "ticks"
    handle = await case.start(python(TICKER, counter))
    await wait_for_file(counter)
    await handle.signal(signal.SIGSTOP)
    await anyio.sleep(0.1)  # a tick in flight lands
    frozen = read_counter(counter)
    await anyio.sleep(0.3)
    assert read_counter(counter) == frozen
    assert handle.returncode is None
    await handle.signal(signal.SIGCONT)
    assert await holds_within(lambda: read_counter(counter) > frozen, timeout=5)
    assert await handle.terminate(grace=5) == -signal.SIGTERM


async def test_terminate_lets_a_handler_exit_cleanly(case: Case) -> None:
    ready = case.workdir / "ready"
    handle = await case.start(python(TERM_EXITS_0, ready))
    await wait_for_file(ready)
    begun = time.monotonic()
    assert await handle.terminate(grace=60) == 0
    assert time.monotonic() - begun < 30  # it did not sit out the grace


async def test_terminate_escalates_to_sigkill_after_grace(case: Case) -> None:
    ready = case.workdir / "ready"
    handle = await case.start(python(TERM_IGNORED, ready))
    await wait_for_file(ready)
    begun = time.monotonic()
    assert await handle.terminate(grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - begun >= 0.5


async def test_terminate_reaches_a_stopped_process(case: Case) -> None:
    ready = case.workdir / "ready"
    handle = await case.start(python(TERM_EXITS_0, ready))
    await wait_for_file(ready)
    await handle.signal(signal.SIGSTOP)
    assert await handle.terminate(grace=10) == 0


async def test_signal_and_terminate_after_exit_do_not_raise(case: Case) -> None:
    handle = await case.start(python(EXIT_3))
    assert await handle.wait() == 3
    await handle.signal(signal.SIGKILL)
    await handle.signal(signal.SIGSTOP)
    assert await handle.terminate(grace=0.1) == 3


async def test_aclose_kills_every_running_process(case: Case) -> None:
    handles = [await case.start(python(SLEEP), host=h) for h in HOSTS]
    finished = await case.start(python(EXIT_3))
    assert await finished.wait() == 3
    assert await holds_within(lambda: len(marked_pids(case.marker)) >= 2, timeout=5)
    await case.backend.aclose()
    assert await wait_until_no_marked(case.marker) == []
    assert [h.returncode for h in handles] == [-signal.SIGKILL] * len(handles)
    with pytest.raises(BackendError):
        await case.start(python(EXIT_3))


async def test_cancelling_start_leaves_nothing_running(case: Case) -> None:
    cancelled = 0
    for delay in (0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2):
        handle = None
        with anyio.move_on_after(delay):
            handle = await case.start(python(SLEEP))
        if handle is None:
            cancelled += 1
            assert await wait_until_no_marked(case.marker) == [], f"leak at delay {delay}"
        else:
            assert await handle.terminate(grace=0) in (-signal.SIGTERM, -signal.SIGKILL)
    assert cancelled >= 1


async def test_unknown_host_is_unreachable(case: Case) -> None:
    with pytest.raises(HostUnreachableError) as info:
        await case.start(python(EXIT_3), host=HostId("nowhere"))
    assert info.value.host == "nowhere"


@pytest.mark.parametrize("argv", [[], [""]])
async def test_bad_argv_is_refused(case: Case, argv: list[str]) -> None:
    with pytest.raises(BackendError):
        await case.backend.start(case.host, ProcessSpec(argv=argv))


async def test_bad_environment_name_is_refused(case: Case) -> None:
    with pytest.raises(BackendError):
        await case.backend.start(case.host, ProcessSpec(argv=python(EXIT_3), env={"A=B": "x"}))


async def test_missing_program_fails_at_start_or_exits_127(case: Case) -> None:
    # Local and SSH refuse at start; in a container the init process reports it as 127.
    try:
        handle = await case.start(["/nonexistent/nbos-program"])
    except BackendError as exc:
        assert case.kind != "docker"
        assert "nbos-program" in str(exc)
    else:
        assert case.kind == "docker"
        assert await handle.wait() == 127


async def test_concurrent_starts_on_every_host(case: Case) -> None:
    handles: list[ProcessHandle] = []

    async def start_one(host: HostId, code: int) -> None:
        handles.append(await case.start(python(f"import sys; sys.exit({code})"), host=host))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(start_one, HOSTS[i % 2], i)
    statuses = sorted([await h.wait() for h in handles])
    assert statuses == list(range(6))
