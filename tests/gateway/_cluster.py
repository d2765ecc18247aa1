"""A real cluster in one process: host agents and a GPU scheduler over an in-memory network.

Virtual GPUs only; agents can be stopped and restarted (a new agent incarnation
on the same host id), and the network can cut links, so tests drive the real
components through their faults.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import attrs

from nbos.agent import EvictHook, HostAgent
from nbos.core.ids import HostId, KernelId
from nbos.gateway import GpuScheduler
from nbos.gpu import GpuPool
from nbos.scaling import ClusterDecisions, FairShare
from nbos.transport import MemoryNetwork, MemoryTransport

GATEWAY = "gateway"


def agent_peer(host: str, generation: int = 0) -> str:
    return f"{host}/agent" if generation == 0 else f"{host}/agent.{generation}"


@attrs.define
class Cluster:
    network: MemoryNetwork
    gateway: MemoryTransport
    scheduler: GpuScheduler
    tg: anyio.abc.TaskGroup
    ttl: float
    clock: Callable[[], float]
    agents: dict[str, HostAgent] = attrs.Factory(dict)
    stops: dict[str, tuple[anyio.CancelScope, anyio.Event]] = attrs.Factory(dict)
    generations: dict[str, int] = attrs.Factory(dict)

    def pool(self, host: str) -> GpuPool:
        return self.agents[host].pool

    async def start_agent(
        self,
        host: str,
        devices: Sequence[int],
        *,
        pool: GpuPool | None = None,
        on_evict: EvictHook | None = None,
        evict_timeout: float = 1.0,
        heartbeat: float = 0.05,
    ) -> HostAgent:
        generation = self.generations.get(host, -1) + 1
        self.generations[host] = generation
        own = pool if pool is not None else GpuPool(devices, self.clock, self.ttl)
        agent: HostAgent = await self.tg.start(
            self._run_agent, host, generation, own, on_evict, evict_timeout, heartbeat
        )
        self.agents[host] = agent
        return agent

    async def stop_agent(self, host: str) -> None:
        scope, done = self.stops.pop(host)
        scope.cancel()
        await done.wait()

    async def _run_agent(
        self,
        host: str,
        generation: int,
        pool: GpuPool,
        on_evict: EvictHook | None,
        evict_timeout: float,
        heartbeat: float,
        *,
        task_status: anyio.abc.TaskStatus[HostAgent],
    ) -> None:
        done = anyio.Event()
        endpoint = self.network.endpoint(agent_peer(host, generation))
        try:
            with anyio.CancelScope() as scope:
                self.stops[host] = (scope, done)
                async with HostAgent.serve(
                    host,
                    endpoint,
                    pool,
                    gateway=GATEWAY,
                    gateway_address=self.gateway.address,
                    on_evict=on_evict,
                    evict_timeout=evict_timeout,
                    heartbeat_interval=heartbeat,
                    clock=self.clock,
                    expire_interval=0.02,
                ) as agent:
                    task_status.started(agent)
                    await anyio.sleep_forever()
        finally:
            await endpoint.aclose()
            done.set()


@asynccontextmanager
async def cluster(
    hosts: Mapping[str, Sequence[int]],
    *,
    ttl: float = 30.0,
    policy: str | ClusterDecisions = "least-loaded",
    clock: Callable[[], float] = time.monotonic,
    fair_share: FairShare | None = None,
    rpc_timeout: float = 0.5,
) -> AsyncIterator[Cluster]:
    """Agents for ``hosts`` (host -> device indices) and a scheduler that has heard from all.

    ``rpc_timeout``: how long the scheduler waits for an agent's answer; short, so that
    a partitioned host is suspected soon.
    """
    network = MemoryNetwork(seed=1)
    gateway = network.endpoint(GATEWAY)
    async with (
        GpuScheduler.serve(
            gateway,
            policy,
            rpc_timeout=rpc_timeout,
            retry_interval=0.05,
            host_timeout=1.0,
            poll_interval=0.1,
            fair_share=fair_share,
        ) as scheduler,
        anyio.create_task_group() as tg,
    ):
        c = Cluster(network, gateway, scheduler, tg, ttl, clock)
        for host, devices in hosts.items():
            await c.start_agent(host, devices)
        await scheduler.wait_for_hosts(len(hosts), timeout=5)
        yield c
        tg.cancel_scope.cancel()
    await gateway.aclose()


def replicas(*hosts: str) -> dict[int, HostId]:
    """Replica id -> host, replica ids from 0 in the order given."""
    return {i: HostId(h) for i, h in enumerate(hosts)}


def kernel(name: str) -> KernelId:
    return KernelId(name)
