"""What the throwaway servers share: a free port, waiting until ready, stopping by PID.

:func:`serve_or_skip` is the one piece that speaks pytest: every fixture that
wraps a server is that one call.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

_START_ATTEMPTS = 3


class ServerUnavailableError(RuntimeError):
    """The server cannot run here (no binary, no permission): tests that need it should skip."""


class _Server(Protocol):
    @property
    def log(self) -> Path | None: ...

    def stop(self) -> None: ...


_S = TypeVar("_S", bound=_Server)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name is in parentheses and may contain spaces; the state follows it.
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def wait_ready(
    process: subprocess.Popen[bytes],
    probe: Callable[[], bool],
    timeout_s: float,
    interval_s: float,
) -> bool:
    """Poll ``probe`` until it says ready (True), ``process`` exits, or ``timeout_s`` passes.

    An ``OSError`` from ``probe`` (nothing listens yet) counts as not ready.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if probe():
                return True
        except OSError:
            pass
        time.sleep(interval_s)
    return False


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM ``process``, SIGKILL it after ``timeout_s``, and reap it; nothing if it ended."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_on_free_port(name: str, launch: Callable[[int], _S], ready: Callable[[_S], bool]) -> _S:
    """``launch`` a server on a free port until ``ready`` says it came up.

    The free port may be taken between probing and binding, so a failed start is
    stopped and tried again on another port. Raises ``RuntimeError`` quoting the
    server's log when every attempt fails.
    """
    for _ in range(_START_ATTEMPTS):
        server = launch(free_port())
        if ready(server):
            return server
        server.stop()
    log = server.log.read_text()[-2000:] if server.log else ""
    raise RuntimeError(f"{name} did not start; its log:\n{log}")


def serve_or_skip(start: Callable[[], _S], needs: str) -> Iterator[_S]:
    """The body of a fixture: yield the started server and stop it afterwards.

    Skips the test (saying it ``needs`` the server) when the server cannot run here.
    """
    try:
        server = start()
    except ServerUnavailableError as exc:
        pytest.skip(f"needs {needs}: {exc}")
    try:
        yield server
    finally:
        server.stop()
