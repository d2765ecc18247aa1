"""Replica liveness as the front sees it: standby replicas, deaths, heartbeats.

Real ZeroMQ sockets on loopback stand in for the replicas' heartbeat channels (a
replica's heartbeat is a plain echo), no replica processes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio

from nbos.core.errors import ConfigError
from nbos.kernel.front import HeartbeatPolicy, ReplicaEndpoint
from nbos.kernel.front._liveness import Liveness
from nbos.kernel.front._upstream import Upstream
from nbos.kernel.protocol import CLAIM_FRESH_S, MIN_PING_TIMEOUT_S

pytestmark = pytest.mark.anyio

#: Quick pings; a ping has long to answer (the echo shares a loaded event loop).
FAST = HeartbeatPolicy(interval_s=0.05, timeout_s=2.0, misses=2, idle_interval_s=0.05)


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def _free_ports(ctx: zmq.asyncio.Context) -> dict[str, Any]:
    """A replica's connection info with ports nobody listens on."""
    ports: dict[str, Any] = {"ip": "127.0.0.1", "key": ""}
    for name in ("shell_port", "control_port", "stdin_port", "iopub_port", "hb_port"):
        sock = ctx.socket(zmq.ROUTER)
        ports[name] = sock.bind_to_random_port("tcp://127.0.0.1")
        sock.close(0)
    return ports


@pytest.fixture
async def echo(ctx: zmq.asyncio.Context) -> AsyncIterator[int]:
    """A heartbeat echo, as a replica's; its port."""
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    async with anyio.create_task_group() as tg:

        async def serve() -> None:
            while True:
                await sock.send_multipart(await sock.recv_multipart())

        tg.start_soon(serve)
        yield port
        tg.cancel_scope.cancel()
    sock.close(0)


def group(ctx: zmq.asyncio.Context, hb_ports: dict[int, int | None]) -> dict[int, Upstream]:
    """Upstreams to replicas whose heartbeat is at ``hb_ports`` (``None``: nobody there)."""
    upstreams = {}
    for replica, hb in hb_ports.items():
        connection = _free_ports(ctx)
        if hb is not None:
            connection["hb_port"] = hb
        upstreams[replica] = Upstream(ReplicaEndpoint(replica, connection), ctx)
    return upstreams


async def test_a_replica_held_back_takes_no_request_but_counts_for_a_majority(
    ctx: zmq.asyncio.Context,
) -> None:
    # Two of three restarted in place and probed: the kernel's log can commit (their Raft
    # members run), but a cell must go to the survivor, whose output surely reaches us.
    upstreams = group(ctx, {1: None, 2: None, 3: None})
    liveness = Liveness("k", upstreams, FAST, busy=lambda: False)
    with liveness.held_back(1), liveness.held_back(2):
        assert liveness.alive == (3,)
        assert liveness.has_quorum
    assert liveness.alive == (1, 2, 3)
    liveness.mark_dead(3, "test")
    with liveness.held_back(1):
        assert liveness.alive == (2,)
        assert liveness.has_quorum
        liveness.mark_dead(2, "test")
        assert not liveness.has_quorum


async def test_a_standby_replica_counts_only_once_activated(ctx: zmq.asyncio.Context) -> None:
    upstreams = group(ctx, {1: None, 2: None, 3: None})
    liveness = Liveness("k", upstreams, FAST, busy=lambda: False)
    liveness.standby(3)
    assert liveness.alive == (1, 2) and liveness.members == (1, 2, 3)
    liveness.mark_dead(2, "test")
    # One of two counted replicas: no majority until the third joins.
    assert not liveness.has_quorum
    assert liveness.activate(3) and not liveness.activate(3)
    assert liveness.alive == (1, 3) and liveness.has_quorum
    for up in upstreams.values():
        up.close()


async def test_listeners_hear_of_each_death_once(ctx: zmq.asyncio.Context) -> None:
    upstreams = group(ctx, {1: None, 2: None})
    liveness = Liveness("k", upstreams, FAST, busy=lambda: False)
    heard: list[tuple[int, str]] = []
    liveness.on_dead(lambda replica, reason: heard.append((replica, reason)))
    liveness.mark_dead(1, "exited")
    liveness.mark_dead(1, "exited again")
    liveness.mark_dead(9, "never was")
    assert heard == [(1, "exited")]
    for up in upstreams.values():
        up.close()


async def test_missed_heartbeats_mark_a_replica_dead_and_echoes_keep_one_alive(
    ctx: zmq.asyncio.Context, echo: int
) -> None:
    upstreams = group(ctx, {1: echo, 2: None})
    liveness = Liveness("k", upstreams, FAST, busy=lambda: False)
    heard: list[int] = []
    dead = anyio.Event()

    def died(replica: int, reason: str) -> None:
        heard.append(replica)
        dead.set()

    liveness.on_dead(died)
    async with anyio.create_task_group() as tg:
        for up in upstreams.values():
            tg.start_soon(liveness.watch, up)
        with anyio.fail_after(60):
            await dead.wait()
        # Replica 1 answered every ping meanwhile, idle pauses included.
        for _ in range(10):
            liveness.request_seen()
            await anyio.sleep(FAST.interval_s)
        tg.cancel_scope.cancel()
    assert heard == [2] and liveness.alive == (1,)
    for up in upstreams.values():
        up.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("interval_s", 0.0), ("timeout_s", -1.0), ("misses", 0), ("idle_interval_s", 0.0)],
)
def test_a_heartbeat_policy_refuses_values_that_are_not_positive(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        HeartbeatPolicy(**{field: value})


def test_a_heartbeat_policy_refuses_a_ping_timeout_a_fresh_claim_could_outlive() -> None:
    # A replica runs a cell sent right after its last one without a read barrier,
    # trusting that no front gives it up within CLAIM_FRESH_S.
    with pytest.raises(ConfigError, match="timeout_s"):
        HeartbeatPolicy(timeout_s=CLAIM_FRESH_S)
    assert HeartbeatPolicy(timeout_s=MIN_PING_TIMEOUT_S).timeout_s == MIN_PING_TIMEOUT_S
