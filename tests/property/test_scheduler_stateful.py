"""Stateful property test of the gateway's GPU scheduler against real host agents.

Three agents with virtual GPUs and a real :class:`GpuScheduler` run over the
in-memory network inside a blocking portal; hypothesis drives random acquires
(some of which must wait and are given up), commits, releases (with and
without lazy residency), pre-commit expiry (the pools' clock is advanced by
hand), replica and kernel deaths and agent restarts (a new agent with an empty pool, which
the scheduler must give back its committed reservations). After every step:

* no device is bound to two committed cells, on the scheduler's side or the agents';
* every committed grant is committed on its agent with the same devices;
* counts never go negative and every pool's counts add up;
* once the scheduler has settled, no agent holds a reservation the scheduler
  does not know (nothing leaks);
* when every kernel is gone, every pool is idle with nothing resident.

Sizes: ``NBOS_PROPERTY_EXAMPLES`` (default 15) and ``NBOS_PROPERTY_STEPS`` (default 25).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nbos.core.errors import GpuError, InsufficientGpusError
from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant
from tests.gateway._cluster import Cluster, cluster
from tests.property._support import ManualClock, sized

HOSTS = {"h0": (0, 1, 2), "h1": (0, 1), "h2": (0, 1, 2, 3)}
REPLICAS = {0: HostId("h0"), 1: HostId("h1"), 2: HostId("h2")}
KERNELS = tuple(KernelId(f"k{i}") for i in range(4))
TTL = 10.0
#: How long a rule lets an acquire wait before giving it up.
PATIENCE = 0.1
#: How long the scheduler waits for an agent's answer.
RPC_TIMEOUT = 30.0

kernels = st.sampled_from(KERNELS)


class SchedulerAccounting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self._portal_cm = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self._cluster_cm = self.portal.wrap_async_context_manager(
            # Nothing here partitions a host: an agent that does not answer within the
            # unit tests' 0.5 s is one a loaded machine held up, and a call to it failed.
            cluster(HOSTS, ttl=TTL, clock=self.clock, rpc_timeout=RPC_TIMEOUT)
        )
        self.c: Cluster = self._cluster_cm.__enter__()
        self.grants: dict[KernelId, Grant] = {}
        self.committed: set[str] = set()
        self.next_index = 0

    def teardown(self) -> None:
        self._cluster_cm.__exit__(None, None, None)
        self._portal_cm.__exit__(None, None, None)

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(func, *args)

    # --- rules -----------------------------------------------------------------

    @rule(kernel=kernels, gpus=st.integers(0, 5), last=st.sampled_from([None, 0, 1, 2]))
    def acquire(self, kernel: KernelId, gpus: int, last: int | None) -> None:
        if kernel in self.grants:
            return
        self.next_index += 1
        if gpus > max(len(d) for d in HOSTS.values()):
            with pytest.raises(InsufficientGpusError):
                self.call(self._acquire_at_once, kernel, gpus)
            return

        async def attempt() -> Grant | None:
            with anyio.move_on_after(PATIENCE):
                return await self.c.scheduler.acquire(
                    kernel, self.next_index, REPLICAS, last_executor=last, gpus=gpus
                )
            return None

        grant = self.call(attempt)
        if grant is not None:
            assert len(grant.devices) == gpus
            assert grant.host == REPLICAS[grant.replica]
            self.grants[kernel] = grant

    @precondition(
        lambda self: any(g.reservation_id not in self.committed for g in self.grants.values())
    )
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        pending = sorted(
            k for k, g in self.grants.items() if g.reservation_id not in self.committed
        )
        kernel = data.draw(st.sampled_from(pending))
        try:
            grant = self.call(self.c.scheduler.committed, self.grants[kernel])
        except GpuError:
            # The pre-commit expired or was lost and its devices are taken: the
            # front would not run the cell, and releases it.
            self.call(self._release, self.grants.pop(kernel), False)
            return
        assert len(grant.devices) == len(self.grants[kernel].devices)
        self.grants[kernel] = grant
        self.committed.add(grant.reservation_id)

    @precondition(lambda self: bool(self.grants))
    @rule(data=st.data(), resident=st.booleans())
    def release(self, data: st.DataObject, resident: bool) -> None:
        kernel = data.draw(st.sampled_from(sorted(self.grants)))
        grant = self.grants.pop(kernel)
        self.committed.discard(grant.reservation_id)
        self.call(self._release, grant, resident)

    @rule(kernel=kernels)
    def kernel_dies(self, kernel: KernelId) -> None:
        grant = self.grants.pop(kernel, None)
        if grant is not None:
            self.committed.discard(grant.reservation_id)
        self.call(self.c.scheduler.kernel_gone, kernel)
        assert all(g.kernel_id != kernel for g in self.c.scheduler.grants())

    @rule(kernel=kernels, host=st.sampled_from(sorted(HOSTS)))
    def replica_dies(self, kernel: KernelId, host: str) -> None:
        grant = self.grants.get(kernel)
        if grant is not None and grant.host == host:
            del self.grants[kernel]
            self.committed.discard(grant.reservation_id)
        self.call(self.c.scheduler.replica_gone, kernel, HostId(host))
        assert kernel not in self.c.pool(host).resident().values()

    @rule()
    def precommits_expire(self) -> None:
        self.clock.now += TTL
        self.call(anyio.sleep, 0.05)

    @rule(host=st.sampled_from(sorted(HOSTS)))
    def agent_restarts(self, host: str) -> None:
        self.call(self._restart, host)

    @rule()
    def everything_dies(self) -> None:
        for kernel in KERNELS:
            self.call(self.c.scheduler.kernel_gone, kernel)
        self.grants.clear()
        self.committed.clear()
        self.call(self._settle)
        for host, agent in self.c.agents.items():
            counts = agent.pool.counts()
            assert counts.idle == counts.total, (host, agent.pool.reservations())
            assert agent.pool.resident() == {}
        assert self.c.scheduler.grants() == ()

    # --- invariants --------------------------------------------------------------

    @invariant()
    def no_device_bound_twice(self) -> None:
        bound: dict[tuple[HostId, int], str] = {}
        for grant in self.c.scheduler.grants():
            if grant.reservation_id not in self.committed:
                continue
            for device in grant.devices:
                key = (grant.host, device)
                assert key not in bound, (key, bound[key], grant.reservation_id)
                bound[key] = grant.reservation_id
        for host, agent in self.c.agents.items():
            owners = [a for a in agent.pool.reservations() for _ in a.devices]
            devices = [d for a in agent.pool.reservations() for d in a.devices]
            assert len(devices) == len(set(devices)), (host, owners)

    @invariant()
    def committed_grants_are_committed_on_their_agents(self) -> None:
        for grant in self.grants.values():
            if not grant.devices or grant.reservation_id not in self.committed:
                continue
            alloc = self.c.pool(grant.host).lookup(grant.reservation_id)
            assert alloc is not None and alloc.state == "committed", (grant, alloc)
            assert alloc.devices == grant.devices

    @invariant()
    def counts_never_negative(self) -> None:
        for agent in self.c.agents.values():
            counts = agent.pool.counts()
            assert min(counts.idle, counts.precommitted, counts.committed) >= 0
            assert counts.idle + counts.precommitted + counts.committed == counts.total
        for view in self.c.scheduler.view().hosts:
            assert 0 <= view.gpus_committed <= view.gpus_total
            assert view.gpus_subscribed >= 0

    @invariant()
    def nothing_leaks_once_settled(self) -> None:
        self.call(self._settle)

    # --- helpers (run in the portal's event loop) ---------------------------------

    async def _acquire_at_once(self, kernel: KernelId, gpus: int) -> None:
        # Refused, not waited for (a wait would last until the limit): not a speed check.
        with anyio.fail_after(RPC_TIMEOUT):
            await self.c.scheduler.acquire(
                kernel, self.next_index, REPLICAS, last_executor=None, gpus=gpus
            )

    async def _release(self, grant: Grant, resident: bool) -> None:
        await self.c.scheduler.release(grant, resident=resident)

    async def _settle(self) -> None:
        """Wait until every agent's live reservations are grants the scheduler knows."""
        with anyio.fail_after(20):
            while True:
                known = {g.reservation_id for g in self.c.scheduler.grants()}
                held = {
                    a.reservation_id
                    for agent in self.c.agents.values()
                    for a in agent.pool.reservations()
                }
                if held <= known:
                    return
                await anyio.sleep(0.02)

    async def _restart(self, host: str) -> None:
        await self.c.stop_agent(host)
        agent = await self.c.start_agent(host, HOSTS[host])
        mine = {
            g.reservation_id for g in self.grants.values() if g.host == host and g.devices
        } & self.committed
        with anyio.fail_after(20):
            while not mine <= {a.reservation_id for a in agent.pool.committed()}:  # noqa: ASYNC110
                await anyio.sleep(0.02)


TestSchedulerAccounting = SchedulerAccounting.TestCase
TestSchedulerAccounting.settings = sized(examples=15, steps=25)
pytestmark = pytest.mark.timeout(600)
