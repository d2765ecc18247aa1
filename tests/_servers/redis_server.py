"""Start and stop a throwaway ``redis-server`` on a free loopback port.

A fixture wraps it with :func:`tests._servers._process.serve_or_skip`, which skips
the test when there is no ``redis-server`` (:class:`RedisUnavailableError`).

The server persists nothing (``--save "" --appendonly no``), listens on 127.0.0.1
only, and is stopped by the PID this module started.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests._servers._process import (
    ServerUnavailableError,
    start_on_free_port,
    stop_process,
    wait_ready,
)

BINARY = "redis-server"


class RedisUnavailableError(ServerUnavailableError):
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
        stop_process(self.process, timeout_s)


def start_redis(workdir: Path, ready_timeout_s: float = 10.0) -> RedisServer:
    """Start ``redis-server`` in ``workdir`` and wait until it answers PING.

    Raises :class:`RedisUnavailableError` if the binary is missing, ``RuntimeError`` if it
    does not come up (the message quotes its log).
    """
    binary = shutil.which(BINARY)
    if binary is None:
        raise RedisUnavailableError(f"{BINARY} is not installed (apt-get install redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    return start_on_free_port(
        BINARY,
        lambda port: _launch(binary, workdir, port),
        lambda server: wait_ready(server.process, lambda: _pings(server), ready_timeout_s, 0.02),
    )


def _launch(binary: str, workdir: Path, port: int) -> RedisServer:
    log = workdir / f"redis-{port}.log"
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log)]  # fmt: skip
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return RedisServer(port=port, process=process, log=log)


def _pings(server: RedisServer) -> bool:
    with socket.create_connection(("127.0.0.1", server.port), timeout=1.0) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")
