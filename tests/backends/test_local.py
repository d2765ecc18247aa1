"""Local-backend specifics: log files, run directory, config."""

from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path

import anyio
import pytest

from nbos.backends import LocalProcessBackend
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError, ConfigError
from nbos.core.ids import HostId
from tests.backends._procs import (
    LEAVES_A_CHILD,
    MARKER_ENV,
    marked_pids,
    python,
    wait_for_file,
    wait_until_no_marked,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

H1 = HostId("h1")
TALK = "import sys; print('to out', flush=True); print('to err', file=sys.stderr)"


async def test_output_goes_to_a_log_file_per_process(tmp_path: Path) -> None:
    backend = LocalProcessBackend([H1], run_dir=tmp_path)
    try:
        first = await backend.start(H1, ProcessSpec(python(TALK), label="talker/1"))
        second = await backend.start(H1, ProcessSpec(python("print('second')")))
        assert await first.wait() == 0
        assert await second.wait() == 0
    finally:
        await backend.aclose()
    assert first.log_path.parent == tmp_path / "h1"
    assert first.log_path.name == "0000-talker_1.log"
    assert (await anyio.Path(first.log_path).read_text()).splitlines() == ["to out", "to err"]
    assert (await anyio.Path(second.log_path).read_text()) == "second\n"


async def test_a_process_that_fails_is_a_warning_quoting_the_end_of_its_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nbos.backends.local")
    backend = LocalProcessBackend([H1], run_dir=tmp_path)
    noisy = "import sys; print('x' * 9000); sys.exit('ValueError: no such thing')"
    try:
        failed = await backend.start(H1, ProcessSpec(python(noisy), label="replica-1"))
        fine = await backend.start(H1, ProcessSpec(python("print('fine')"), label="replica-2"))
        assert await failed.wait() == 1
        assert await failed.wait() == 1  # told once, however often it is waited for
        assert await fine.wait() == 0
    finally:
        await backend.aclose()
    messages = [r.getMessage() for r in caplog.records]
    (warning,) = [m for m in messages if "failed with exit code" in m]
    assert warning.startswith(f"process replica-1 (pid {failed.pid}) on h1 failed with exit code 1")
    # The end of its output (its traceback, usually), not all of it.
    assert warning.endswith("ValueError: no such thing") and len(warning) < 4200


async def test_without_run_dir_logs_go_to_a_fresh_temporary_directory() -> None:
    backend = LocalProcessBackend([H1])
    assert LocalProcessBackend([H1]).run_dir is None  # made on the first start
    try:
        handle = await backend.start(H1, ProcessSpec(python("print('hi')")))
        assert await handle.wait() == 0
    finally:
        await backend.aclose()
    assert backend.run_dir is not None
    assert handle.log_path.is_relative_to(backend.run_dir)
    assert handle.log_path.read_text() == "hi\n"


async def test_unwritable_run_dir_is_a_backend_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    backend = LocalProcessBackend([H1], run_dir=blocker)
    with pytest.raises(BackendError, match="log file"):
        await backend.start(H1, ProcessSpec(python("pass")))


@pytest.mark.parametrize("hosts", [[], ["a", "a"], "ab"])
def test_bad_hosts_are_refused(hosts: list[str]) -> None:
    with pytest.raises(ConfigError):
        LocalProcessBackend(hosts)


async def test_what_a_process_left_running_ends_with_it(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    ready = tmp_path / "child.pid"
    spec = ProcessSpec(python(LEAVES_A_CHILD, ready), env={MARKER_ENV: marker})
    backend = LocalProcessBackend([H1], run_dir=tmp_path)
    try:
        handle = await backend.start(H1, spec)
        assert await handle.wait() == 0
        await wait_for_file(ready)  # the grandchild was started
        assert await wait_until_no_marked(marker) == []
    finally:
        await backend.aclose()
        for pid in marked_pids(marker):  # left by a failed run: the test started it
            os.kill(pid, signal.SIGKILL)
