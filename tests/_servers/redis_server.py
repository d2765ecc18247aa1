"""Start and stop a throwaway ``redis-server`` on a free loopback port.

Framework-neutral, so any test directory can wrap it in a fixture::

    try:
        server = start_redis(tmp_dir)
    except RedisUnavailableError as exc:
        pytest.skip(str(exc))
    ...
    server.stop()

The server persists nothing (``--save "" --appendonly no``), listens on 127.0.0.1
only, and is stopped by the PID this module started.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BINARY = "redis-server"
_START_ATTEMPTS = 3


class RedisUnavailableError(RuntimeError):
    """No ``redis-server`` binary: tests that need one should skip."""


@dataclass
class RedisServer:
    """A running server; ``url`` points at its database 0."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``timeout_s``) and reap it."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(workdir: Path, ready_timeout_s: float = 10.0) -> RedisServer:
    """Start ``redis-server`` in ``workdir`` and wait until it answers PING.

    Raises :class:`RedisUnavailableError` if the binary is missing, ``RuntimeError`` if it
    does not come up (the message quotes its log).
    """
    binary = shutil.which(BINARY)
    if binary is None:
        raise RedisUnavailableError(f"{BINARY} is not installed (apt-get install redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    for _ in range(_START_ATTEMPTS):
        # The free port may be taken between probing and binding; then try another.
        server = _launch(binary, workdir, _free_port())
        if _wait_for_ping(server, ready_timeout_s):
            return server
        server.stop()
    raise RuntimeError(f"{BINARY} did not start; its log:\n{server.log.read_text()[-2000:]}")


def _launch(binary: str, workdir: Path, port: int) -> RedisServer:
    log = workdir / f"redis-{port}.log"
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log)]  # fmt: skip
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return RedisServer(port=port, process=process, log=log)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_ping(server: RedisServer, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False
