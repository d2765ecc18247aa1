"""The ``swarm`` host provider on a real one-node swarm (a private ``dockerd``, swarm init).

Standby nodes are the labelled nodes with availability ``drain``: adding a host makes one
active and names it by its hostname; removing it drains it again; with no standby node
left (or none labelled) adding is refused, and nothing else changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from nbos.core.errors import BackendError, ConfigError
from nbos.core.host_provider import AgentCommand
from nbos.core.ids import HostId
from nbos.gateway.providers import SwarmHostProvider
from nbos.transport.ports import free_loopback_ports
from tests._servers._process import serve_or_skip
from tests._servers.dockerd import DockerDaemon, start_dockerd

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

LABEL = "nbos.test-gpu"
AGENT = AgentCommand(gateway="127.0.0.1:1", gpus=1, heartbeat_s=1.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    """A private engine made a one-node swarm's manager (never the system's engine)."""
    for daemon in serve_or_skip(
        lambda: start_dockerd(tmp_path_factory.mktemp("swarm"), private=True), "a dockerd"
    ):
        (port,) = free_loopback_ports(1)
        where = json.dumps({"ListenAddr": f"127.0.0.1:{port}", "AdvertiseAddr": "127.0.0.1"})
        status, body = daemon.request("POST", "/swarm/init", where.encode())
        if status != 200:
            pytest.skip(f"needs a swarm: swarm init answered {status} {body[-300:]!r}")
        yield daemon


def node(daemon: DockerDaemon) -> dict[str, Any]:
    (only,) = json.loads(daemon.request("GET", "/nodes")[1])
    assert isinstance(only, dict)
    return only


def set_node(daemon: DockerDaemon, **spec: Any) -> None:
    now = node(daemon)
    body = json.dumps({**now["Spec"], **spec}).encode()
    status, answer = daemon.request(
        "POST", f"/nodes/{now['ID']}/update?version={now['Version']['Index']}", body
    )
    assert status == 200, answer


async def test_standby_nodes_are_made_active_and_drained_again(manager: DockerDaemon) -> None:
    provider = SwarmHostProvider(engine=manager.url, label=LABEL)
    hostname = node(manager)["Description"]["Hostname"]
    try:
        # Drained but not labelled: not a standby node of this cluster.
        set_node(manager, Availability="drain", Labels={})
        with pytest.raises(BackendError, match="no standby swarm node"):
            await provider.add_host(AGENT)
        assert node(manager)["Spec"]["Availability"] == "drain"

        # Labelled but active: in use already.
        set_node(manager, Availability="active", Labels={LABEL: "true"})
        with pytest.raises(BackendError, match="no standby swarm node"):
            await provider.add_host(AGENT)

        set_node(manager, Availability="drain")
        assert await provider.add_host(AGENT) == hostname
        assert node(manager)["Spec"]["Availability"] == "active"
        with pytest.raises(BackendError, match="none of the 1 nodes labelled"):
            await provider.add_host(AGENT)

        await provider.remove_host(HostId(hostname))
        assert node(manager)["Spec"]["Availability"] == "drain"
        await provider.remove_host(HostId("not-a-node"))  # nothing to do

        # Shutting the gateway down drains what the provider made active.
        assert await provider.add_host(AGENT) == hostname
    finally:
        await provider.aclose()
    assert node(manager)["Spec"]["Availability"] == "drain"
    assert node(manager)["Spec"]["Labels"] == {LABEL: "true"}


async def test_a_provider_without_a_manager_or_label_is_refused(manager: DockerDaemon) -> None:
    with pytest.raises(ConfigError):
        SwarmHostProvider(engine="/var/run/docker.sock")
    with pytest.raises(ConfigError):
        SwarmHostProvider(engine=manager.url, label="")
    lost = SwarmHostProvider(engine="unix:///nonexistent/docker.sock")
    try:
        with pytest.raises(BackendError, match="list nodes"):
            await lost.add_host(AGENT)
    finally:
        await lost.aclose()
