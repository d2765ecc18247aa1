"""``nbos agent`` as a real process, driven by a gateway endpoint on the real ZeroMQ transport."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.agent import process_start_ticks
from nbos.agent._replicas import ReplicaRecord
from nbos.core.wire.agent import (
    AgentError,
    AgentHello,
    AgentRestore,
    AgentStatus,
    AgentStatusRequest,
    GpuCommit,
    GpuFreed,
    GpuGranted,
    GpuPrecommit,
    GpuRelease,
    GpuReservation,
    ReplicaExitAck,
    ReplicaExited,
    ReplicaInfo,
    ReplicaList,
    ReplicaListRequest,
    ReplicaSignal,
    ReplicaSpec,
    ReplicaStart,
    ReplicaState,
    ReplicaStop,
)
from nbos.transport.keys import KeyDirectory, generate_keys
from tests._servers.netns import Netns, netns_or_skip
from tests.agent._daemons import (
    DEADLINE,
    SLEEPER,
    AgentProcess,
    FakeGateway,
    Where,
    alive,
    fake_gateway,
    recorded,
    start_agent,
)

pytestmark = pytest.mark.anyio

AGENT = "h1/agent"


async def _poll(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (a file or process state nothing signals)."""
    with anyio.fail_after(DEADLINE):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def _start(gw: FakeGateway, replica_id: str, argv: list[str] = SLEEPER) -> ReplicaInfo:
    reply = await gw.call(AGENT, lambda rid: ReplicaStart(rid, replica_id, ReplicaSpec(argv)))
    assert isinstance(reply, ReplicaState), reply
    return reply.replica


async def test_registers_over_curve_and_serves_gpu_requests(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    generate_keys(tmp_path / "keys", ["h1"])
    keys = KeyDirectory(tmp_path / "keys")
    async with fake_gateway(tmp_path, keys=tmp_path / "keys") as gw:
        agent = start_agent("h1", gw.address, tmp_path, keys=tmp_path / "keys")
        agents.append(agent)
        hello = await gw.welcome("h1")
        assert hello.public_key.encode() == keys.host_public("h1")
        assert (hello.gpu_source, [g.index for g in hello.gpus]) == ("virtual", [0, 1])
        assert hello.address.startswith("tcp://127.0.0.1:") and not hello.address.endswith(":0")
        await _poll(lambda: "registered with the gateway" in agent.log_text())

        pre = await gw.call(AGENT, lambda rid: GpuPrecommit(rid, "res-1", "k1", 1))
        assert isinstance(pre, GpuGranted) and pre.reservation.state == "precommitted"
        done = await gw.call(AGENT, lambda rid: GpuCommit(rid, "res-1", "k1", 1))
        assert isinstance(done, GpuGranted) and done.reservation.state == "committed"
        assert done.reservation.devices == pre.reservation.devices
        freed = await gw.call(AGENT, lambda rid: GpuRelease(rid, "res-1"))
        assert isinstance(freed, GpuFreed) and freed.devices == pre.reservation.devices
        status = await gw.call(AGENT, AgentStatusRequest)
        assert isinstance(status, AgentStatus) and status.reservations == []
        assert status.incarnation == hello.incarnation


async def test_an_agent_with_a_foreign_key_is_refused(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    generate_keys(tmp_path / "ours", ["h1"])
    generate_keys(tmp_path / "theirs", ["h1"])
    # It knows the right gateway key, but its own key pair is not one the gateway holds.
    shutil.copy(tmp_path / "ours" / "gateway.key", tmp_path / "theirs" / "gateway.key")
    foreign = KeyDirectory(tmp_path / "theirs").host_public("h1").decode()
    async with fake_gateway(tmp_path, keys=tmp_path / "ours") as gw:
        agent = start_agent("h1", gw.address, tmp_path, keys=tmp_path / "theirs")
        agents.append(agent)
        await _poll(lambda: f"refused CURVE client key b'{foreign}'" in gw.log.read_text())
        assert not [m for _, m in gw.received if isinstance(m, AgentHello)]
        assert agent.process.poll() is None


async def test_replicas_start_signal_stop_and_their_exits_are_reported(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agent = start_agent("h1", gateway.address, tmp_path)
    agents.append(agent)
    await gateway.welcome("h1")
    first = await _start(gateway, "r1")
    assert first.running and alive(first.pid)
    assert await _start(gateway, "r1") == first  # a retried start starts nothing more

    os.kill(first.pid, signal.SIGKILL)
    exited = await gateway.wait_for(ReplicaExited, lambda m: m.replica.replica_id == "r1")
    assert (exited.replica.running, exited.replica.signal, exited.replica.exit_code) == (
        False,
        signal.SIGKILL,
        None,
    )
    await gateway.send(AGENT, ReplicaExitAck("r1"))

    fail = "import sys; sys.stderr.write('ValueError: no such thing\\n'); sys.exit(3)"
    second = await _start(gateway, "r2", ["python3", "-c", fail])
    ended = await gateway.wait_for(ReplicaExited, lambda m: m.replica.replica_id == "r2")
    assert (ended.replica.exit_code, ended.replica.signal) == (3, None)
    assert ended.replica.pid == second.pid
    # A failure is a warning that quotes the end of the replica's output.
    warning = f"process r2 (pid {second.pid}) on h1 failed with exit code 3"
    await _poll(lambda: warning in agent.log_text())
    assert "ValueError: no such thing" in agent.log_text().split(warning, 1)[1]
    await gateway.send(AGENT, ReplicaExitAck("r2"))

    third = await _start(gateway, "r3")
    stopped = await gateway.call(AGENT, lambda rid: ReplicaStop(rid, "r3", grace=30.0))
    assert isinstance(stopped, ReplicaState)
    assert (stopped.replica.running, stopped.replica.signal) == (False, signal.SIGTERM)
    assert not alive(third.pid)
    await gateway.send(AGENT, ReplicaExitAck("r3"))

    async def listed() -> list[str]:
        reply = await gateway.call(AGENT, ReplicaListRequest)
        assert isinstance(reply, ReplicaList)
        return [r.replica_id for r in reply.replicas]

    with anyio.fail_after(DEADLINE):
        while await listed():  # noqa: ASYNC110  (acks have no answer: ask until applied)
            await anyio.sleep(0.1)
    assert recorded(agents[0].state_dir) == []
    unknown = await gateway.call(AGENT, lambda rid: ReplicaSignal(rid, "r9", signal.SIGTERM))
    assert isinstance(unknown, AgentError) and unknown.kind == "unknown_replica"


async def test_a_restarted_agent_takes_back_its_live_replicas_and_pool_but_not_a_reused_pid(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(start_agent("h1", gateway.address, tmp_path))
    hello = await gateway.welcome("h1")
    live = await _start(gateway, "live")
    committed = await gateway.call(AGENT, lambda rid: GpuCommit(rid, "res-1", "k1", 1))
    assert isinstance(committed, GpuGranted)
    agents[0].kill(signal.SIGKILL)
    agents[0].wait()
    assert alive(live.pid)

    # A record whose PID now names another process: same PID, other start time.
    stranger = subprocess.Popen(SLEEPER)  # noqa: ASYNC220
    try:
        ticks = process_start_ticks(stranger.pid)
        assert ticks is not None
        record = ReplicaRecord(
            "reused", "", stranger.pid, ticks - 1, recorded(agents[0].state_dir)[0].boot_id, 0.0
        )
        path = agents[0].state_dir / "replicas" / "reused.json"
        path.write_bytes(msgspec.json.encode(record))

        seen = len(gateway.received)
        agents.append(start_agent("h1", gateway.address, tmp_path))
        again = await gateway.welcome("h1", after=seen)
        assert again.incarnation != hello.incarnation
        by_id = {r.replica_id: r for r in again.replicas}
        assert by_id["live"].running and by_id["live"].adopted and by_id["live"].pid == live.pid
        reused = await gateway.wait_for(
            ReplicaExited, lambda m: m.replica.replica_id == "reused", after=seen
        )
        assert (reused.replica.exit_code, reused.replica.signal) == (None, None)
        assert stranger.poll() is None  # not ours: never signalled

        # The pool comes back through the gateway's restore.
        reservation = GpuReservation("res-1", "k1", committed.reservation.devices, "committed")
        restored = await gateway.call(AGENT, lambda rid: AgentRestore(rid, [reservation]))
        assert isinstance(restored, GpuFreed) and restored.reservation_ids == ["res-1"]
        status = await gateway.call(AGENT, AgentStatusRequest)
        assert isinstance(status, AgentStatus)
        assert [(r.reservation_id, r.state) for r in status.reservations] == [
            ("res-1", "committed")
        ]

        # The adopted replica is signalled and watched as before.
        await gateway.call(AGENT, lambda rid: ReplicaSignal(rid, "live", signal.SIGKILL))
        gone = await gateway.wait_for(
            ReplicaExited, lambda m: m.replica.replica_id == "live", after=seen
        )
        assert gone.replica.adopted and not alive(live.pid)
    finally:
        stranger.kill()
        stranger.wait()


async def test_sigterm_leaves_replicas_running_unless_asked_to_stop_them(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(start_agent("h1", gateway.address, tmp_path))
    await gateway.welcome("h1")
    replica = await _start(gateway, "r1")
    agents[0].kill(signal.SIGTERM)
    assert agents[0].wait() == 0
    assert alive(replica.pid)

    seen = len(gateway.received)
    agents.append(start_agent("h1", gateway.address, tmp_path, extra=["--stop-replicas-on-exit"]))
    hello = await gateway.welcome("h1", after=seen)
    assert [r.replica_id for r in hello.replicas if r.running] == ["r1"]
    agents[1].kill(signal.SIGINT)
    assert agents[1].wait() == 0
    await _poll(lambda: not alive(replica.pid))


async def test_a_second_agent_on_the_same_state_directory_is_refused(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(start_agent("h1", gateway.address, tmp_path))
    await gateway.welcome("h1")
    replica = await _start(gateway, "r1")
    # As a second `nbos cluster up` once started one: it must not race the first.
    agents.append(start_agent("h1", gateway.address, tmp_path))
    assert agents[1].wait() != 0
    assert "a state directory no running agent uses" in agents[1].log_text()
    assert agents[0].process.poll() is None and alive(replica.pid)
    # Killed, the first one lets go of it: an agent started then takes its replica back.
    agents[0].kill()
    agents[0].wait()
    seen = len(gateway.received)
    agents.append(start_agent("h1", gateway.address, tmp_path))
    hello = await gateway.welcome("h1", after=seen)
    assert [r.replica_id for r in hello.replicas if r.running] == ["r1"]


async def test_bad_messages_get_typed_errors_and_the_agent_lives_on(
    tmp_path: Path, gateway: FakeGateway, agents: list[AgentProcess]
) -> None:
    agents.append(start_agent("h1", gateway.address, tmp_path))
    await gateway.welcome("h1")
    await gateway.send(AGENT, b"\x93not a message")
    malformed = await gateway.wait_for(AgentError, lambda e: e.kind == "malformed")
    assert malformed.request_id is None
    await gateway.send(AGENT, GpuFreed(77))
    unexpected = await gateway.wait_for(AgentError, lambda e: e.kind == "unexpected")
    assert unexpected.request_id == 77
    bad_id = await gateway.call(AGENT, lambda rid: ReplicaStart(rid, "../x", ReplicaSpec(SLEEPER)))
    assert isinstance(bad_id, AgentError) and bad_id.kind == "invalid"
    no_argv = await gateway.call(AGENT, lambda rid: ReplicaStart(rid, "r1", ReplicaSpec([])))
    assert isinstance(no_argv, AgentError) and no_argv.kind == "start_failed"
    bad_signal = await gateway.call(AGENT, lambda rid: ReplicaSignal(rid, "r1", 999))
    assert isinstance(bad_signal, AgentError) and bad_signal.kind == "invalid"
    listed = await gateway.call(AGENT, ReplicaListRequest)
    assert isinstance(listed, ReplicaList) and listed.replicas == []
    assert agents[0].process.poll() is None
    assert "malformed message" in agents[0].log_text()


@pytest.fixture
def net() -> Iterator[Netns]:
    yield from netns_or_skip(["gw", "a", "b"])


async def test_two_agents_in_their_own_namespaces_register_at_their_own_addresses(
    tmp_path: Path, net: Netns, agents: list[AgentProcess]
) -> None:
    generate_keys(tmp_path / "keys", ["a", "b"])
    keys = tmp_path / "keys"

    def inside(host: str) -> Where:
        return lambda argv: net.argv(host, argv)

    bind = f"tcp://{net.address('gw')}:7000"
    async with fake_gateway(tmp_path, bind, keys, where=inside("gw")) as gw:
        for host in ("a", "b"):
            address = f"{net.address(host)}:7001"
            agents.append(
                start_agent(
                    host, gw.address, tmp_path, address=address, keys=keys, where=inside(host)
                )
            )
        for host in ("a", "b"):
            hello = await gw.welcome(host)
            assert hello.address == f"tcp://{net.address(host)}:7001"
            grant = await gw.call(f"{host}/agent", lambda rid: GpuPrecommit(rid, "res", "k", 2))
            assert isinstance(grant, GpuGranted) and grant.reservation.devices == [0, 1]

        # Cut b off: its reports stop while a's go on; heal it: they come back.
        net.partition("b")
        await _statuses(gw, "a", 3)  # what b sent before the cut has landed by now
        cut = len(gw.received)
        await _statuses(gw, "a", 10, after=cut)
        assert [m for s, m in gw.received[cut:] if s == "b/agent"] == []
        net.heal("b")
        await gw.wait_for(AgentStatus, lambda s: s.host_id == "b", after=cut)


async def _statuses(gw: FakeGateway, host: str, n: int, after: int = 0) -> None:
    """Wait until ``host`` sent ``n`` heartbeats since message ``after``."""

    def enough() -> bool:
        sent = [m for _, m in gw.received[after:] if isinstance(m, AgentStatus)]
        return sum(m.host_id == host for m in sent) >= n

    await _poll(enough)
