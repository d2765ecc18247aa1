"""``nbos chaos`` against a gateway: a cluster that ``nbos cluster up`` started on this
machine, its gateway and an agent ``kill -9``ed and started again, a replica killed
through the gateway's control API; every check of the toolkit after each fault.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbos.chaos import PlannedFault, plan_faults
from nbos.deploy._up import RECORD
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE, ROOT

# A cluster's start, three faults and their checks: slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

NEMESES = ["kill-executor", "kill-gateway", "kill-agent"]


def nbos(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbos", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=12 * DEADLINE,
        check=False,
    )


@pytest.fixture
def cluster_file(tmp_path: Path) -> Iterator[Path]:
    """A cluster of 4 local hosts, up; down at the end."""
    control, agents = free_loopback_ports(2)
    # The agents run as this interpreter's nbos: the console script need not be on PATH.
    command = json.dumps([sys.executable, "-m", "nbos"])
    hosts = "".join(
        f'[[hosts]]\nname = "h{i}"\naddress = "127.0.0.1"\nstart = "local"\ngpus = 1\n'
        f"command = {command}\n\n"
        for i in range(1, 5)
    )
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[gateway]\naddress = "127.0.0.1:{control}"\nagent_address = "127.0.0.1:{agents}"\n'
        # Slack for a loaded machine: an agent killed and started again is not given up.
        f"heartbeat_s = 0.5\nmissed_heartbeats = 30\n\n{hosts}"
    )
    up = nbos("cluster", "up", str(path))
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        yield path
    finally:
        down = nbos("cluster", "down", str(path))
        assert down.returncode == 0, down.stderr[-3000:]


@pytest.mark.long  # over a minute of chaos: `make test` keeps the netns and control-plane ones
def test_chaos_against_a_cluster_kills_its_gateway_an_agent_and_a_replica(
    cluster_file: Path, tmp_path: Path
) -> None:
    # The first seed whose first three faults are the three nemeses, one each.
    seed = next(
        s for s in range(1000) if sorted(f.nemesis for f in _first(s, 3)) == sorted(NEMESES)
    )
    record = cluster_file.parent / "run" / RECORD
    gateway_pid = json.loads(record.read_text())["gateway"]["pid"]
    argv = ["chaos", "--cluster", str(cluster_file), "--seed", str(seed), "--max-faults", "3"]
    argv += ["--duration", "600", "--run-dir", str(tmp_path)]
    for name in NEMESES:
        argv += ["--nemesis", name]

    done = nbos(*argv)

    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-5000:]}"
    rows = [line.split() for line in done.stdout.splitlines()]
    struck = [row[1] for row in rows if len(row) > 1 and row[0].isdigit()]
    assert sorted(struck) == sorted(NEMESES), done.stdout
    # The gateway that answers now is the one chaos started again, not the first.
    assert json.loads(record.read_text())["gateway"]["pid"] != gateway_pid


def test_a_gateway_nemesis_without_a_cluster_file_is_refused(tmp_path: Path) -> None:
    done = nbos("chaos", "--gateway", "127.0.0.1:9", "--nemesis", "kill-agent")
    assert done.returncode != 0
    assert "needs gateway-processes, which the gateway at 127.0.0.1:9 does not have" in (
        done.stderr
    )


def _first(seed: int, n: int) -> list[PlannedFault]:
    return list(itertools.islice(plan_faults(seed, NEMESES), n))
