"""Pre-started replica processes (``[agent] warm_replicas``): handed out, refilled, checked."""

from __future__ import annotations

import json
import os
import signal
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.agent import AgentConfig
from nbos.backends.workdir import PYTHON_TOKEN, WORKDIR_TOKEN
from nbos.core.config import AgentSettings, Settings
from nbos.core.errors import ConfigError
from nbos.core.wire.agent import (
    ReplicaConnection,
    ReplicaConnectionRequest,
    ReplicaSpec,
    ReplicaStart,
    ReplicaState,
    ReplicaStop,
)
from nbos.gateway.service import GatewayService
from nbos.transport.ports import free_loopback_address
from tests.agent._daemons import DEADLINE, AgentProcess, FakeGateway, alive, start_agent
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

WARM_ARGV = ["-m", "nbos.kernel.replica", "--warm"]
TEMPLATE_ARGV = ["-m", "nbos.kernel.replica", "--template"]


def _proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _words(pid: int) -> list[str]:
    """Its command line's words: a fork retitles itself with one string (setproctitle)."""
    return _proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").split()


def warm_by_agent() -> dict[int, set[int]]:
    """The pre-started replicas of this process's agents (its children, or its
    templates' children), by agent pid."""
    found: dict[int, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _words(int(entry))[1:] != WARM_ARGV:
            continue
        parent = _parent(int(entry))
        if parent and _words(parent)[1:] == TEMPLATE_ARGV:
            parent = _parent(parent)
        if parent and _parent(parent) == os.getpid():
            found.setdefault(parent, set()).add(int(entry))
    return found


def _parent(pid: int) -> int:
    stat = _proc(pid, "stat").decode()
    return int(stat.rpartition(")")[2].split()[1]) if stat else 0


async def pools_full(agents: int, size: int, without: set[int] = frozenset()) -> set[int]:
    """Poll until ``agents`` agents each hold ``size`` warm processes not in ``without``."""
    with anyio.fail_after(2 * DEADLINE):
        while True:
            pools = {a: p - without for a, p in warm_by_agent().items()}
            if len(pools) >= agents and all(len(p) >= size for p in pools.values()):
                return set().union(*pools.values())
            await anyio.sleep(0.2)


async def test_a_kernel_starts_on_warm_replicas_survives_a_kill_and_the_pools_refill(
    tmp_path: Path,
) -> None:
    settings = msgspec.structs.replace(
        local_settings(tmp_path), agent=AgentSettings(warm_replicas=1)
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        warm = await pools_full(agents=3, size=1)
        kernel = await service.kernel_manager.start_kernel()
        pids = {r.pid for r in kernel.replicas}
        # Every replica is a process that was running before the kernel was asked for,
        # a fork of its host's template (the default).
        assert pids <= warm, (pids, warm)
        assert all(forked(pid) for pid in pids if pid is not None)
        assert (await kernel.execute("x = 41")).status == "ok"

        victim = next(r for r in kernel.replicas if r.pid is not None)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        # The first cell after the kill may be reported lost (if it hit the victim);
        # one re-run must then succeed on the two left.
        result = await kernel.execute("x += 1; print(x)", timeout=DEADLINE)
        if result.status != "ok":
            result = await kernel.execute("x += 1; print(x)", timeout=DEADLINE)
        assert result.status == "ok", result.reply
        assert result.stdout.strip() == "42"  # a lost cell left no trace

        # Each agent started a new one in the background.
        await pools_full(agents=3, size=1, without=warm)
        await kernel.shutdown()


def replica_spec(tmp_path: Path) -> ReplicaSpec:
    """A real one-member replica, as the gateway asks for one."""
    peers = {1: [free_loopback_address(), free_loopback_address()]}
    argv = [PYTHON_TOKEN, "-m", "nbos.kernel.replica"]
    argv += ["--connection-file", f"{WORKDIR_TOKEN}/connection.json", "--kernel-id", "k1"]
    argv += ["--node-id", "1", "--raft-peers", json.dumps(peers), "--store", str(tmp_path)]
    return ReplicaSpec(argv, {}, "k1-1", "k1/replica-1", "key")


async def test_a_taken_warm_replica_is_adopted_and_waiting_ones_are_replaced_or_end_with_the_agent(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(
        start_agent("h1", gateway.address, tmp_path, env={"NBOS_AGENT__WARM_REPLICAS": "1"})
    )
    await gateway.welcome("h1")
    [warm] = await pools_full(agents=1, size=1)
    assert forked(warm)
    spec = replica_spec(tmp_path)
    reply = await gateway.call("h1/agent", lambda rid: ReplicaStart(rid, "k1-1", spec))
    assert isinstance(reply, ReplicaState) and reply.replica.pid == warm
    await bound(gateway, "k1-1")  # it became that replica: a kernel that bound its ports
    [refill] = await pools_full(agents=1, size=1, without={warm})
    # One that dies while it waits is replaced (after a pause, as it lived only briefly).
    os.kill(refill, signal.SIGKILL)
    [refill] = await pools_full(agents=1, size=1, without={warm, refill})

    agents[0].kill(signal.SIGKILL)
    agents[0].wait()
    with anyio.fail_after(DEADLINE):
        while alive(refill):  # noqa: ASYNC110 - nothing signals a process's end here
            await anyio.sleep(0.05)
    assert alive(warm)

    seen = len(gateway.received)
    agents.append(
        start_agent("h1", gateway.address, tmp_path, env={"NBOS_AGENT__WARM_REPLICAS": "0"})
    )
    hello = await gateway.welcome("h1", after=seen)
    [info] = hello.replicas
    assert (info.replica_id, info.pid, info.running, info.adopted) == ("k1-1", warm, True, True)


async def bound(gateway: FakeGateway, replica_id: str) -> None:
    """Wait until the replica's kernel bound its ports (its connection info is there)."""
    with anyio.fail_after(DEADLINE):
        while True:
            answer = await gateway.call(
                "h1/agent", lambda rid: ReplicaConnectionRequest(rid, replica_id)
            )
            assert isinstance(answer, ReplicaConnection)
            if answer.info:
                return
            await anyio.sleep(0.1)


def forked(pid: int) -> bool:
    """Whether ``pid`` is a fork of a replica template (its parent, while it runs)."""
    return _words(_parent(pid))[1:] == TEMPLATE_ARGV


def memory_kib(pid: int) -> dict[str, int]:
    lines = _proc(pid, "smaps_rollup").decode().splitlines()
    return {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in lines) if v}


async def test_forks_share_their_template_s_pages_and_the_agent_stops_them_by_pid(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(
        start_agent("h1", gateway.address, tmp_path, env={"NBOS_AGENT__WARM_REPLICAS": "2"})
    )
    await gateway.welcome("h1")
    waiting = await pools_full(agents=1, size=2)
    assert all(forked(pid) for pid in waiting)
    for pid in waiting:
        # Most of a fork's pages are its template's (shared, counted in part in its
        # proportional set), where a process started from scratch holds its own.
        memory = memory_kib(pid)
        assert memory["Private_Clean"] + memory["Private_Dirty"] < memory["Rss"] / 2, memory

    spec = replica_spec(tmp_path)
    reply = await gateway.call("h1/agent", lambda rid: ReplicaStart(rid, "k1-1", spec))
    assert isinstance(reply, ReplicaState) and reply.replica.pid in waiting
    await bound(gateway, "k1-1")
    stopped = await gateway.call("h1/agent", lambda rid: ReplicaStop(rid, "k1-1", grace=0.5))
    assert isinstance(stopped, ReplicaState)
    info = stopped.replica
    assert not info.running and not alive(info.pid)
    # The template reaped it and told its agent how it ended: known, as for a child.
    assert (info.exit_code, info.signal) != (None, None), info


async def test_a_template_killed_mid_fork_fails_no_start_and_the_pool_refills(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(
        start_agent("h1", gateway.address, tmp_path, env={"NBOS_AGENT__WARM_REPLICAS": "1"})
    )
    await gateway.welcome("h1")
    [warm] = await pools_full(agents=1, size=1)
    template = _parent(warm)
    # Stopped, the template leaves the refill's fork request unanswered; killed then, it
    # ends with that request (or before it came) in its socket.
    os.kill(template, signal.SIGSTOP)
    await start_and_bind(gateway, tmp_path, "k1-1")
    assert alive(warm)
    os.kill(template, signal.SIGKILL)
    # The refill falls back to a process started from scratch (or a new template), and
    # starts go on: each becomes a kernel.
    [refill] = await pools_full(agents=1, size=1, without={warm})
    assert refill != template
    await start_and_bind(gateway, tmp_path, "k2-1")
    assert alive(warm)


async def start_and_bind(gateway: FakeGateway, tmp_path: Path, replica_id: str) -> None:
    """Start a one-member replica ``replica_id`` and wait until its kernel bound its ports."""
    spec = msgspec.structs.replace(
        replica_spec(tmp_path), label=replica_id, workdir=f"{replica_id}/replica-1"
    )
    reply = await gateway.call("h1/agent", partial(ReplicaStart, replica_id=replica_id, spec=spec))
    assert isinstance(reply, ReplicaState) and reply.replica.running
    await bound(gateway, replica_id)


def test_the_setting_is_validated_where_it_is_read() -> None:
    assert Settings.load(env={}).agent.pool_size == 2
    assert Settings.load(env={"NBOS_AGENT__WARM_REPLICAS": "0"}).agent.pool_size == 0
    assert Settings.load(env={}).agent.forks
    assert not Settings.load(env={"NBOS_AGENT__FORK_REPLICAS": "false"}).agent.forks
    with pytest.raises(ConfigError) as caught:
        Settings.load(env={"NBOS_AGENT__FORK_REPLICAS": "sometimes"})
    assert caught.value.key == "agent.fork_replicas"
    docker = {"NBOS_AGENT__RUNTIME": "docker", "NBOS_AGENT__DOCKER_IMAGE": "nbos:1"}
    assert Settings.load(env=docker).agent.pool_size == 0  # containers have no pool
    for bad in ("-1", "65", "two"):
        with pytest.raises(ConfigError) as caught:
            Settings.load(env={"NBOS_AGENT__WARM_REPLICAS": bad})
        assert caught.value.key == "agent.warm_replicas"
    for settings in (
        AgentSettings(warm_replicas=-1),
        AgentSettings(runtime="docker", docker_image="nbos:1", warm_replicas=1),
    ):
        with pytest.raises(ConfigError) as caught:
            AgentConfig("h1", "127.0.0.1:1", "127.0.0.1:2", Path("/tmp"), settings=settings)
        assert caught.value.key == "agent.warm_replicas"
    for settings in (
        AgentSettings(warm_replicas=0, fork_replicas=True),
        AgentSettings(runtime="docker", docker_image="nbos:1", fork_replicas=False),
    ):
        with pytest.raises(ConfigError) as caught:
            AgentConfig("h1", "127.0.0.1:1", "127.0.0.1:2", Path("/tmp"), settings=settings)
        assert caught.value.key == "agent.fork_replicas"
