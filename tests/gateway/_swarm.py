"""A one-node Docker Swarm for tests: a private ``dockerd`` (never the system's engine)
made a swarm's manager, and its node's availability and labels set through its API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbos.transport.ports import free_loopback_ports
from tests._servers._process import serve_or_skip
from tests._servers.dockerd import DockerDaemon, start_dockerd


def swarm_manager(workdir: Path) -> Iterator[DockerDaemon]:
    """The body of a fixture: the manager, stopped (with its swarm) afterwards; skips the
    test where no dockerd runs or ``swarm init`` fails."""
    for daemon in serve_or_skip(lambda: start_dockerd(workdir, private=True), "a dockerd"):
        (port,) = free_loopback_ports(1)
        where = json.dumps({"ListenAddr": f"127.0.0.1:{port}", "AdvertiseAddr": "127.0.0.1"})
        status, body = daemon.request("POST", "/swarm/init", where.encode())
        if status != 200:
            pytest.skip(f"needs a swarm: swarm init answered {status} {body[-300:]!r}")
        yield daemon


def node(daemon: DockerDaemon) -> dict[str, Any]:
    """The swarm's only node, as the API shows it."""
    (only,) = json.loads(daemon.request("GET", "/nodes")[1])
    assert isinstance(only, dict)
    return only


def set_node(daemon: DockerDaemon, **spec: Any) -> None:
    """Change the node's spec (``Availability``, ``Labels``), as ``docker node update``."""
    now = node(daemon)
    body = json.dumps({**now["Spec"], **spec}).encode()
    status, answer = daemon.request(
        "POST", f"/nodes/{now['ID']}/update?version={now['Version']['Index']}", body
    )
    assert status == 200, answer
