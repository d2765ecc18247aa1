"""The host directory's way out, over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import anyio
import pytest

from nbos.core.wire import decode, encode
from nbos.core.wire.agent import AgentHello, AgentStatus, AgentWelcome
from nbos.gateway import HostDirectory
from nbos.transport import ZmqTransport

pytestmark = pytest.mark.anyio

#: Status reports queued at the gateway as its directory exits: more than its receive
#: loop takes between two turns of the event loop, so it is mid-way through them.
FLOOD = 2000


async def register(agent: ZmqTransport, gateway: ZmqTransport) -> AgentStatus:
    """Say hello to ``gateway`` as host h1's agent; once welcome, its status report."""
    agent.add_peer(gateway.local, gateway.address)
    hello = AgentHello("h1", "i1", agent.address, "0", "local", "virtual")
    await agent.send(gateway.local, encode(hello))
    with anyio.fail_after(30):
        while not isinstance(decode((await agent.receive())[1]), AgentWelcome):
            pass
    return AgentStatus("h1", "i1", agent.address, [0])


async def test_a_directory_exiting_while_an_agent_floods_it_with_status_ends_cleanly() -> None:
    """Regression: the scheduler's inbox was closed before the receive loop ended, so a
    report taken off the socket just then ended the gateway in ``ClosedResourceError``."""
    async with (
        await ZmqTransport.open("gateway") as gateway,
        await ZmqTransport.open("h1/agent") as agent,
    ):
        async with HostDirectory.serve(gateway, replicas_per_kernel=1) as directory:
            status = encode(await register(agent, gateway))
            for _ in range(FLOOD):
                await agent.send(gateway.local, status)
            await anyio.sleep(0.01)
        assert [h.host_id for h in directory.hosts()] == ["h1"]
