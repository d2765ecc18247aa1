"""The gateway's side of `nbos agent`: registration, liveness, processes, with real agents."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient

from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import HostUnreachableError
from nbos.core.ids import HostId, KernelId
from nbos.gateway import HOST_LOST_STATUS
from nbos.kernel.front import KernelFront, ReplicaEndpoint
from nbos.transport.keys import generate_keys
from tests._servers.netns import Netns, netns_or_skip
from tests.agent._daemons import (
    DEADLINE,
    ROOT,
    SLEEPER,
    AgentProcess,
    alive,
    start_agent,
)
from tests.gateway._agents import gateway_side, single_replica

pytestmark = pytest.mark.anyio

H1, H2 = HostId("h1"), HostId("h2")


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys", ["h1", "h2"])
    return tmp_path / "keys"


async def _poll(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(DEADLINE):
        while not condition():  # noqa: ASYNC110  (process states nothing signals)
            await anyio.sleep(0.05)


async def test_agents_register_over_curve_and_run_processes_for_the_backend(
    tmp_path: Path, keys: Path, agents: list[AgentProcess]
) -> None:
    async with gateway_side(keys) as gw:
        for host in ("h1", "h2"):
            agents.append(start_agent(host, gw.address, tmp_path, keys=keys))
        await gw.directory.wait_for_hosts(2, timeout=DEADLINE)
        assert sorted(gw.backend.hosts()) == [H1, H2]
        view = gw.directory.scheduler.view()
        assert [(h.host_id, h.gpus_total, h.schedulable) for h in view.hosts] == [
            (H1, 2, True),
            (H2, 2, True),
        ]

        # GPU requests reach the agents over the CURVE links registration made.
        scheduler = gw.directory.scheduler
        grant = await scheduler.acquire(
            KernelId("k1"), 1, {1: H1, 2: H2}, last_executor=None, gpus=2
        )
        grant = await scheduler.committed(grant)
        assert len(grant.devices) == 2
        await scheduler.release(grant)

        killed = await gw.backend.start(H1, ProcessSpec(SLEEPER, label="sleeper"))
        assert killed.pid is not None and alive(killed.pid)
        await killed.signal(signal.SIGKILL)
        assert await killed.wait() == -signal.SIGKILL

        stopped = await gw.backend.start(H2, ProcessSpec(SLEEPER))
        assert await stopped.terminate(grace=30.0) == -signal.SIGTERM
        assert stopped.pid is not None and not alive(stopped.pid)

        code = ["python3", "-c", "import sys; sys.exit(3)"]
        exited = await gw.backend.start(H2, ProcessSpec(code))
        assert await exited.wait() == 3

        with pytest.raises(HostUnreachableError):
            await gw.backend.start(HostId("h9"), ProcessSpec(SLEEPER))


async def test_a_replica_on_an_agent_binds_ports_the_agent_chose_and_serves_cells(
    tmp_path: Path, keys: Path, agents: list[AgentProcess]
) -> None:
    async with gateway_side(keys) as gw:
        agents.append(start_agent("h1", gw.address, tmp_path, keys=keys))
        await gw.directory.wait_for_hosts(1, timeout=DEADLINE)
        raft, other = await gw.backend.addresses(H1, 2)
        assert raft.startswith("tcp://127.0.0.1:") and raft != other
        key = secrets.token_hex(32)
        spec = single_replica("k1", raft, str(tmp_path / "store"))
        handle = await gw.backend.start_replica(
            H1, spec, workdir="k1/replica-1", connection_key=key
        )
        info = await gw.backend.connection_info(handle, timeout=DEADLINE)
        assert (info["ip"], info["key"]) == ("127.0.0.1", key)
        workdir = agents[0].state_dir / "work" / "k1" / "replica-1"
        assert (workdir / "connection.json").is_file()

        front = KernelFront([ReplicaEndpoint(1, info)], kernel_id="k1")
        async with anyio.create_task_group() as tg:
            await tg.start(front.serve)
            client = AsyncKernelClient()
            client.load_connection_info(front.connection_info)
            client.start_channels()
            try:
                reply = await client.execute("x = 6 * 7", reply=True, timeout=DEADLINE)
                assert reply["content"]["status"] == "ok"
                reply = await client.execute("x", reply=True, timeout=DEADLINE)
                assert reply["content"]["status"] == "ok"
            finally:
                client.stop_channels()
            front.closing()
            tg.cancel_scope.cancel()
        assert (workdir / "raft").is_dir()  # its Raft log lives on its host
        assert await handle.terminate(grace=5.0) is not None


async def test_a_silent_host_is_suspected_its_processes_run_on_and_are_used_again_when_it_returns(
    tmp_path: Path, keys: Path, agents: list[AgentProcess]
) -> None:
    async with gateway_side(keys) as gw:
        agents.append(start_agent("h1", gw.address, tmp_path, keys=keys))
        await gw.directory.wait_for_hosts(1, timeout=DEADLINE)
        handle = await gw.backend.start(H1, ProcessSpec(SLEEPER))
        assert handle.pid is not None
        # A frozen agent says nothing; its replica runs on, cut off from us.
        agents[0].kill(signal.SIGSTOP)
        with anyio.fail_after(DEADLINE):
            await handle.wait_suspected()
        assert handle.suspected and handle.returncode is None  # suspicion is not proof
        assert gw.backend.hosts() == []
        assert not gw.directory.scheduler.view().hosts[0].schedulable
        assert alive(handle.pid)

        agents[0].kill(signal.SIGCONT)
        await gw.directory.wait_for_hosts(1, timeout=DEADLINE)
        # Back with the process as it was: it is used again, not stopped.
        await _poll(lambda: not handle.suspected)
        assert alive(handle.pid) and handle.returncode is None
        assert gw.directory.scheduler.view().hosts[0].schedulable
        assert await handle.terminate(grace=5.0) is not None
        assert not alive(handle.pid)


async def test_a_process_stopped_while_its_host_is_cut_off_is_stopped_when_the_host_returns(
    tmp_path: Path, keys: Path, agents: list[AgentProcess]
) -> None:
    async with gateway_side(keys) as gw:
        agents.append(start_agent("h1", gw.address, tmp_path, keys=keys))
        await gw.directory.wait_for_hosts(1, timeout=DEADLINE)
        handle = await gw.backend.start(H1, ProcessSpec(SLEEPER))
        assert handle.pid is not None
        agents[0].kill(signal.SIGSTOP)
        with anyio.fail_after(DEADLINE):
            await handle.wait_suspected()
        # Its kernel no longer wants it (shut down, replaced): asked to stop, unreachable.
        with anyio.fail_after(DEADLINE):
            assert await handle.terminate(grace=1.0) == HOST_LOST_STATUS
        assert alive(handle.pid)
        agents[0].kill(signal.SIGCONT)
        await _poll(lambda: handle.pid is not None and not alive(handle.pid))


@pytest.fixture
def net() -> Iterator[Netns]:
    yield from netns_or_skip(["gw", "a", "b", "c"])


async def test_agents_in_their_own_namespaces_run_replicas_bound_to_their_addresses(
    tmp_path: Path, net: Netns, agents: list[AgentProcess]
) -> None:
    hosts = ["a", "b", "c"]
    generate_keys(tmp_path / "keys", hosts)
    keys = tmp_path / "keys"
    gateway = f"{net.address('gw')}:7000"
    for host in hosts:
        agents.append(
            start_agent(
                host,
                gateway,
                tmp_path,
                address=f"{net.address(host)}:7001",
                keys=keys,
                where=lambda argv, host=host: net.argv(host, argv),
            )
        )
    driver = [sys.executable, "-m", "tests.gateway._netns_gateway", f"tcp://{gateway}"]
    driver += [str(keys), str(tmp_path / "store"), *hosts]
    with (tmp_path / "gateway.log").open("ab") as log:
        done = await anyio.run_process(
            net.argv("gw", driver),
            stderr=log,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    assert done.returncode == 0, (tmp_path / "gateway.log").read_text()
    results = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [r["host"] for r in results] == hosts
    for r in results:
        # The replica's Jupyter sockets and Raft port are on its host's address.
        assert r["ip"] == net.address(r["host"])
        assert r["raft"].startswith(f"tcp://{net.address(r['host'])}:")
        assert (r["status"], r["stdout"]) == ("ok", f"{r['host']}\n")


async def test_a_stop_its_host_did_not_answer_is_asked_again_until_the_replica_ended(
    tmp_path: Path, keys: Path, agents: list[AgentProcess]
) -> None:
    """A stop nobody answered leaves a process that may run on with no kernel: it is asked
    again until the host answers. Here the agent is frozen through the stop and then dies,
    so the stop it never read dies with it; its successor takes the replica back and is
    asked again."""
    # The host is never suspected here: a busy agent, not a silent one.
    async with gateway_side(keys, missed=100_000) as gw:
        agents.append(start_agent("h1", gw.address, tmp_path, keys=keys))
        await gw.directory.wait_for_hosts(1, timeout=DEADLINE)
        handle = await gw.backend.start(H1, ProcessSpec(SLEEPER))
        assert handle.pid is not None
        agents[0].kill(signal.SIGSTOP)
        with anyio.fail_after(DEADLINE):
            await handle.terminate(grace=0.1)  # unanswered: given up after its timeout
        assert alive(handle.pid)
        agents[0].kill()  # still frozen: the stops queued for it are never read
        agents[0].wait()
        agents.append(start_agent("h1", gw.address, tmp_path, keys=keys))
        await _poll(lambda: handle.pid is not None and not alive(handle.pid))
