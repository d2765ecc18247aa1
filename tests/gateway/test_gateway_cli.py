"""``nbos gateway`` as a person starts it: what it says at the default log level, and how
it refuses an address in use (issue 30)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT

pytestmark = pytest.mark.timeout(4 * DEADLINE)

_KEYS = ("address", "agent_address", "http_address", "metrics_address")


def _gateway(env: dict[str, str]) -> subprocess.Popen[str]:
    """``nbos gateway`` at its default log level, stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "nbos", "gateway", "--shutdown-kernels-on-exit"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def _settings(tmp_path: Path, **local: str) -> dict[str, str]:
    ports = dict(zip(_KEYS, free_loopback_ports(len(_KEYS)), strict=True))
    return {
        **{f"NBOS_GATEWAY__{k.upper()}": f"127.0.0.1:{p}" for k, p in ports.items()},
        "NBOS_CLUSTER__HOSTS": "3",
        "NBOS_CLUSTER__DATA_DIR": str(tmp_path / "run"),
        **local,
    }


def _line_within(stream: object, timeout: float) -> str:
    assert hasattr(stream, "readline") and hasattr(stream, "fileno")
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    line: str = stream.readline()
    return line


@pytest.fixture
def stopped_after() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_gateway_says_it_is_ready_and_where_at_the_default_log_level(
    tmp_path: Path, stopped_after: list[subprocess.Popen[str]]
) -> None:
    env = _settings(tmp_path, NBOS_GATEWAY__LOCAL_AGENTS="false")
    gateway = _gateway(env)
    stopped_after.append(gateway)
    line = _line_within(gateway.stderr, 2 * DEADLINE)
    assert line.startswith("nbos gateway: ready: "), line
    named = dict(part.split(" ", 1) for part in line.strip().split(": ", 2)[2].split(", "))
    at = {k: env[f"NBOS_GATEWAY__{k.upper()}"] for k in _KEYS}
    assert named == {
        "control": at["address"],
        "agents": at["agent_address"],
        "metrics": f"http://{at['metrics_address']}/metrics",
        "http": f"http://{at['http_address']}",
    }
    # Every one listens.
    for address in at.values():
        host, port = address.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=DEADLINE).close()
    gateway.send_signal(signal.SIGTERM)
    rest = gateway.communicate(timeout=DEADLINE)[1]
    assert gateway.returncode == 0
    assert rest == "", "one line, nothing else, at the default log level"


@pytest.mark.parametrize("key", _KEYS)
def test_an_address_in_use_is_one_line_naming_it_and_its_setting_before_any_agent(
    tmp_path: Path, key: str, stopped_after: list[subprocess.Popen[str]]
) -> None:
    env = _settings(tmp_path)
    taken = env[f"NBOS_GATEWAY__{key.upper()}"]
    host, port = taken.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen()
        gateway = _gateway(env)
        stopped_after.append(gateway)
        begun = time.monotonic()
        err = gateway.communicate(timeout=2 * DEADLINE)[1]
    assert gateway.returncode == 1, err
    assert err.count("\n") == 1, err
    assert err.startswith("nbos: error: ") and "Traceback" not in err, err
    assert f"gateway.{key}" in err and taken in err, err
    # Refused before the 3 local agents were started: none left a record.
    assert not (tmp_path / "run" / "agents").exists() or not any(
        (tmp_path / "run" / "agents").iterdir()
    ), f"agents were started ({time.monotonic() - begun:.1f} s)"
