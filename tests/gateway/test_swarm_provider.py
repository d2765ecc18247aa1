"""The ``swarm`` host provider on a real one-node swarm (a private ``dockerd``, swarm init).

Standby nodes are the labelled nodes with availability ``drain``: adding a host makes one
active and names it by its hostname; removing it drains it again; with no standby node
left (or none labelled) adding is refused, and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nbos.core.errors import BackendError, ConfigError
from nbos.core.host_provider import AgentCommand
from nbos.core.ids import HostId
from nbos.gateway.providers import SwarmHostProvider
from tests._servers.dockerd import DockerDaemon
from tests.gateway._swarm import node, set_node, swarm_manager

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

LABEL = "nbos.test-gpu"
AGENT = AgentCommand(gateway="127.0.0.1:1", gpus=1, heartbeat_s=1.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    yield from swarm_manager(tmp_path_factory.mktemp("swarm"))


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
