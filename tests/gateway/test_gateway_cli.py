"""``nbos gateway`` as a person starts it: what it says at the default log level, and how
it refuses an address in use (issue 30)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT
from tests.gateway._http import call, start_http_gateway, stop

pytestmark = pytest.mark.timeout(4 * DEADLINE)

TOKEN = "operator-secret"
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
        "dashboard": f"http://{at['http_address']}/dashboard/",
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


def _nbos(*argv: str, address: str) -> str:
    """``nbos ARGV`` against the gateway at ``address``; its stdout (it must succeed)."""
    done = subprocess.run(
        [sys.executable, "-m", "nbos", "--token", TOKEN, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NBOS_GATEWAY__ADDRESS": address},
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _warm_under(gateway: int) -> list[int]:
    """The pre-started replicas below the gateway (its local agents' children, or their
    templates' forks, which retitle themselves with one string)."""
    parents: dict[int, int] = {}
    warm = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rpartition(")")[2].split()[1]
            )
        except (OSError, ValueError):
            continue  # not a process, or one that ended meanwhile
        if words[-1:] == [b"--warm"]:
            warm.append(int(entry.name))

    def below(pid: int) -> bool:
        for _ in range(3):  # agent, template
            pid = parents.get(pid, 0)
            if pid == gateway:
                return True
        return False

    return [pid for pid in warm if below(pid)]


def _titles(replicas: list[dict[str, Any]]) -> dict[int, str]:
    """What ``ps`` shows as each replica's command, by node."""
    return {
        r["node"]: subprocess.run(
            ["ps", "-ww", "-o", "args=", "-p", str(r["pid"])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for r in replicas
    }


@pytest.fixture
def http_gateway(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """``nbos gateway --http`` with 3 local agents and their default pool of pre-started
    replicas (those ps showed as ``--warm``): its control address, URL and log."""
    (control,) = free_loopback_ports(1)
    address = f"127.0.0.1:{control}"
    env = {"NBOS_GATEWAY__ADDRESS": address, "NBOS_AGENT__WARM_REPLICAS": "1"}
    process, url, log = start_http_gateway(tmp_path, TOKEN, env)
    deadline = time.monotonic() + 2 * DEADLINE
    while len(_warm_under(process.pid)) < 3:  # each agent's pool is full
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield address, url, log
    stop(process)
    assert "Traceback" not in log.read_text()


@pytest.mark.long
@pytest.mark.anyio
async def test_status_names_kernels_as_the_http_api_does_and_ps_names_each_replica(
    http_gateway: tuple[str, str, Path],
) -> None:
    address, url, _ = http_gateway
    code, model = await call(f"{url}/api/kernels", "POST", {"name": "nbos-gpu-1"}, TOKEN)
    assert code == 201, model
    api_id, first_id = model["id"], model["nbos"]["kernel_id"]
    first = json.loads(_nbos("status", "--json", address=address))["kernels"]
    assert [k["kernel_id"] for k in first] == [first_id]
    for node, title in _titles(first[0]["replicas"]).items():
        assert f"--kernel-id {first_id}" in title and f"--node-id {node}" in title, title

    # An API restart: a new nbos kernel behind the same API id.
    code, _ = await call(f"{url}/api/kernels/{api_id}/restart", "POST", token=TOKEN)
    assert code == 200
    now_id = (await call(f"{url}/api/kernels/{api_id}", token=TOKEN))[1]["nbos"]["kernel_id"]
    assert now_id != first_id

    (kernel,) = json.loads(_nbos("status", "--json", address=address))["kernels"]
    assert (kernel["api_id"], kernel["kernel_id"]) == (api_id, now_id)
    assert kernel["state"] == "idle" and kernel["gpus"] == 1 and kernel["owner"]
    assert 0 <= kernel["age_s"] < 4 * DEADLINE
    for node, title in _titles(kernel["replicas"]).items():
        assert f"--kernel-id {now_id}" in title and f"--node-id {node}" in title, title

    lines = _nbos("status", address=address).splitlines()
    header = next(line for line in lines if line.startswith("KERNEL  "))
    row = next(line for line in lines if line.startswith(api_id))
    shown = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row), strict=True))
    assert shown["NBOS ID"] == now_id and shown["USER"] == kernel["owner"]
    assert shown["STATE"] == "idle" and shown["GPUS"] == "1"
    assert re.fullmatch(r"\d+[smhd]", shown["AGE"]), shown
