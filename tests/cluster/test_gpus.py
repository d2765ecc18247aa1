"""GPUs on demand, end to end, on the embedded cluster with virtual GPUs.

One cluster of 3 hosts with 2 virtual GPUs each serves the module; every kernel
has one replica on each host, so which host a cell runs on is decided by GPUs
alone. Cells that must hold their GPUs while the test looks wait for a flag
file rather than sleep, so nothing depends on timing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import KernelConnectionInfo

import nbos
from nbos.cluster import ExecuteResult, Kernel, LocalCluster
from nbos.core.config import ClusterSettings, Settings
from nbos.core.ids import HostId, KernelId
from nbos.core.placement import PlacementRequest
from nbos.gateway import Eviction, Grant
from nbos.scaling import load_policy
from tests._wait import eventually

pytestmark = pytest.mark.anyio

GPUS_PER_HOST = 2


def virtual_cluster(
    hosts: int = 3,
    placement_policy: str = "least-loaded",
    gpus_per_host: int = GPUS_PER_HOST,
    replace: bool = False,
) -> LocalCluster:
    cluster = ClusterSettings(gpus_per_host=gpus_per_host, placement_policy=placement_policy)
    # Unless ``replace``, dead replicas stay dead: the tests look at what one leaves behind.
    return nbos.LocalCluster(
        hosts,
        durable=False,
        settings=Settings(cluster=cluster),
        gpu_discovery="virtual",
        replace_dead_replicas=replace,
    )


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    async with virtual_cluster() as c:
        yield c


@pytest.fixture(scope="module")
async def a(cluster: LocalCluster) -> Kernel:
    return await cluster.start_kernel(gpus=GPUS_PER_HOST)


@pytest.fixture(scope="module")
async def b(cluster: LocalCluster) -> Kernel:
    return await cluster.start_kernel(gpus=GPUS_PER_HOST)


@pytest.fixture
def flag(tmp_path: Path) -> Path:
    return tmp_path / "go"


def hold_until(flag: Path) -> str:
    """Code that keeps its cell (and so its GPUs) running until ``flag`` exists."""
    return f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\n"


def host_of(kernel: Kernel, result: ExecuteResult) -> HostId:
    return next(r.host for r in kernel.replicas if r.node == result.executor)


def grants_of(cluster: LocalCluster, kernel: Kernel) -> list[Grant]:
    return [g for g in cluster.gpus.scheduler.grants() if g.kernel_id == kernel.kernel_id]


def held_on_agents(cluster: LocalCluster, kernel_id: str) -> dict[HostId, list[object]]:
    """What each agent still holds for the kernel: reservations and resident devices."""
    held: dict[HostId, list[object]] = {}
    for host, agent in cluster.gpus.agents.items():
        things: list[object] = [r for r in agent.pool.reservations() if r.kernel_id == kernel_id]
        things += [d for d, k in agent.pool.resident().items() if k == kernel_id]
        if things:
            held[host] = things
    return held


def subscribed(cluster: LocalCluster) -> list[int]:
    return [h.gpus_subscribed for h in cluster.gpus.scheduler.view().hosts]


async def interrupted(
    kernel: Kernel, code: str, until: Callable[[], Awaitable[object]]
) -> ExecuteResult:
    """Run ``code``; once ``until()`` returns, interrupt it as a Jupyter client would."""
    client = AsyncKernelClient()
    client.load_connection_info(kernel.connection_info)
    client.start_channels()
    results: list[ExecuteResult] = []
    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                results.append(await kernel.execute(code))

            tg.start_soon(run)
            await until()
            client.control_channel.send(client.session.msg("interrupt_request", {}))
    finally:
        client.stop_channels()
    (result,) = results
    return result


def wait_statuses(outputs: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``(status, text)`` of each nbos wait-status output (shown, then updated in place)."""
    return [
        (o["content"]["metadata"]["nbos"]["status"], o["content"]["data"]["text/plain"])
        for o in outputs
        if o["msg_type"] in ("display_data", "update_display_data")
        and "nbos" in o["content"]["metadata"]
    ]


@dataclass
class ClientRun:
    """A cell run by a Jupyter client: when it was sent, its reply, its IOPub messages.

    Times are ``time.monotonic()``; each IOPub message comes with when it arrived.
    """

    sent: float
    reply: dict[str, Any]
    iopub: list[tuple[float, dict[str, Any]]]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """The IOPub messages as :attr:`ExecuteResult.outputs` has them."""
        return [{"msg_type": m["msg_type"], "content": m["content"]} for _, m in self.iopub]


def run_in_jupyter_client(
    info: KernelConnectionInfo, code: str, timeout: float = 60.0
) -> ClientRun:
    """Run ``code`` as any Jupyter client does: a blocking client (call it in a thread)."""
    client = BlockingKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    try:
        client.wait_for_ready(timeout=timeout)
        iopub: list[tuple[float, dict[str, Any]]] = []
        sent = time.monotonic()
        reply = client.execute_interactive(
            code, timeout=timeout, output_hook=lambda msg: iopub.append((time.monotonic(), msg))
        )
        return ClientRun(sent, reply, iopub)
    finally:
        client.stop_channels()


async def running(cluster: LocalCluster, kernel: Kernel) -> Grant:
    """The committed grant of the kernel's running cell, once there is one."""
    await eventually(lambda: bool(grants_of(cluster, kernel)))
    (grant,) = grants_of(cluster, kernel)
    return grant


async def test_kernels_are_placed_by_the_policy_on_distinct_hosts(
    cluster: LocalCluster, a: Kernel, b: Kernel
) -> None:
    for kernel in (a, b):
        assert sorted(r.host for r in kernel.replicas) == ["host-1", "host-2", "host-3"]
    # Each replica subscribes its kernel's GPUs on its host.
    assert subscribed(cluster) == [2 * GPUS_PER_HOST] * 3


async def test_a_second_kernel_runs_on_another_replicas_host(
    cluster: LocalCluster, a: Kernel, b: Kernel, flag: Path
) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.execute, hold_until(flag))
        busy = await running(cluster, a)
        assert len(busy.devices) == GPUS_PER_HOST  # the whole host
        second = await b.execute("from nbos.gpu import devices\nprint(devices())")
        await anyio.Path(flag).touch()
    assert second.status == "ok"
    assert second.stdout == "(0, 1)\n"
    assert host_of(b, second) != busy.host


async def test_the_devices_a_cell_sees_are_the_ones_committed_for_it(
    cluster: LocalCluster, a: Kernel, flag: Path
) -> None:
    code = "%%gpus 1\nfrom nbos.gpu import devices\nprint(devices())\n" + hold_until(flag)
    async with anyio.create_task_group() as tg:
        results: list[ExecuteResult] = []

        async def run() -> None:
            results.append(await a.execute(code))

        tg.start_soon(run)
        grant = await running(cluster, a)
        pool = cluster.gpus.agents[grant.host].pool

        def committed() -> list[Any]:
            return [r for r in pool.committed() if r.kernel_id == a.kernel_id]

        def started() -> bool:
            cells = cluster.gpus.scheduler.ledger.cells()
            return any(c.kernel_id == a.kernel_id and c.started for c in cells)

        # The scheduler lists a grant from its pre-commit on: wait until the agent has
        # committed it and the scheduler has its answer (the cell started).
        await eventually(lambda: bool(committed()) and started())
        held = committed()
        (grant,) = grants_of(cluster, a)  # as committed, with the devices the agent chose
        await anyio.Path(flag).touch()
    (result,) = results
    assert [r.devices for r in held] == [grant.devices] and len(grant.devices) == 1
    assert result.stdout == f"{grant.devices}\n"
    assert host_of(a, result) == grant.host
    assert not grants_of(cluster, a)  # released after the cell


async def test_a_cell_magic_or_metadata_overrides_the_kernels_gpus(a: Kernel) -> None:
    show = "from nbos.gpu import devices\nprint(len(devices()))"
    assert (await a.execute(show)).stdout == "2\n"  # the kernel's default
    one = await a.execute("%%gpus 1\n" + show)
    assert one.stdout == "1\n"
    # The magic line is stripped: the replicas run (and the client is shown) the rest.
    (shown,) = [o for o in one.outputs if o["msg_type"] == "execute_input"]
    assert shown["content"]["code"] == show
    assert (await a.execute("%%gpus 0\n" + show)).stdout == "0\n"
    assert (await a.execute(show, metadata={"nbos": {"gpus": 1}})).stdout == "1\n"
    assert (await a.execute(show, metadata={"resource_request": {"gpus": 0}})).stdout == "0\n"
    bad = await a.execute("%%gpus many\n" + show)
    assert bad.error is not None and bad.error[0] == "GpuError"
    assert (await a.execute(show)).stdout == "2\n"


async def test_more_gpus_than_any_host_has_is_a_clear_error_at_once(
    cluster: LocalCluster, b: Kernel
) -> None:
    result = await b.execute("%%gpus 3\nprint('never')")
    assert result.error is not None
    ename, evalue = result.error
    assert ename == "InsufficientGpusError" and "3 GPUs" in evalue
    # Shown to the client as an error output too; nothing ran and nothing waited (a wait
    # shows a status output first).
    assert [o["msg_type"] for o in result.outputs] == ["error"]
    assert not grants_of(cluster, b)
    after = await b.execute("print('still usable')")
    assert (after.status, after.stdout) == ("ok", "still usable\n")


async def test_a_waiting_cell_is_told_why_and_runs_once_gpus_free_up(
    cluster: LocalCluster, a: Kernel, b: Kernel, flag: Path
) -> None:
    # a leaves tensors on its devices; then it holds one host while the test holds the others.
    await a.execute("import torch\nw = torch.arange(4.0)")
    scheduler = cluster.gpus.scheduler
    runs: list[ClientRun] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.execute, hold_until(flag))
        held = await running(cluster, a)
        hog = KernelId("test-hog")
        hogs = [
            await scheduler.acquire(hog, i, {1: host}, last_executor=None, gpus=GPUS_PER_HOST)
            for i, host in enumerate(sorted(set(cluster.gpus.agents) - {held.host}))
        ]

        async def run_b() -> None:
            # b's user, on a Jupyter client of their own.
            code = "print('ran')"
            runs.append(
                await anyio.to_thread.run_sync(run_in_jupyter_client, b.connection_info, code)
            )

        tg.start_soon(run_b)
        await eventually(lambda: any(k == b.kernel_id for k, _ in scheduler.waiting()))
        freed = time.monotonic()
        await anyio.Path(flag).touch()  # a's cell ends and releases its host
    for grant in hogs:
        await scheduler.release(grant)
    (run,) = runs
    assert run.reply["content"]["status"] == "ok"
    outputs = run.outputs
    assert [o["content"]["text"] for o in outputs if o["msg_type"] == "stream"] == ["ran\n"]
    replica = run.reply["metadata"]["nbos"]["replica"]
    assert next(r.host for r in b.replicas if r.node == replica) == held.host
    # One status output, shown before anything else: why the cell waits, then (replaced
    # in place) that it started; then the cell's own output.
    kinds = [o["msg_type"] for o in outputs if o["msg_type"] != "status"]
    statuses = wait_statuses(outputs)
    updates = ["update_display_data"] * (len(statuses) - 1)
    assert kinds == ["display_data", *updates, "execute_input", "stream"]
    assert [s for s, _ in statuses] == ["waiting"] * (len(statuses) - 1) + ["started"]
    assert all(
        text.startswith("nbos: the cell waits: waiting for 2 GPUs") for _, text in statuses[:-1]
    )
    assert statuses[-1][1].startswith("nbos: the cell started after waiting")
    shown = [(t, m["content"]) for t, m in run.iopub if m["msg_type"].endswith("display_data")]
    assert len({c["transient"]["display_id"] for _, c in shown}) == 1
    assert shown[-1][0] >= freed  # it started once a's cell had ended, not before
    # b took devices holding a's tensors: a's replica there moved them off first (lazy
    # eviction), and a's next cell brings them back.
    assert Eviction(held.host, a.kernel_id, (0, 1)) in cluster.gpus.evictions
    assert (await a.execute("print(w.sum().item())")).stdout == "6.0\n"


async def test_an_interrupted_or_failed_cell_gives_its_gpus_back(
    cluster: LocalCluster, b: Kernel, flag: Path
) -> None:
    # A grant exists before its cell runs: an interrupt then ends the wait instead (the
    # test below), so this one waits for the cell's own code to run.
    code = f"import pathlib, time\npathlib.Path({str(flag)!r}).touch()\ntime.sleep(60)"

    async def started() -> None:
        await eventually(flag.exists)
        assert grants_of(cluster, b)

    result = await interrupted(b, code, started)
    assert result.error is not None and result.error[0] == "KeyboardInterrupt"
    assert not grants_of(cluster, b)
    failed = await b.execute("1 / 0")
    assert failed.error is not None and failed.error[0] == "ZeroDivisionError"
    assert not grants_of(cluster, b)
    assert (await b.execute("print('on')")).stdout == "on\n"


async def test_an_interrupt_ends_a_wait_for_gpus(cluster: LocalCluster, b: Kernel) -> None:
    scheduler = cluster.gpus.scheduler
    hog = KernelId("test-hog")
    hogs = [
        await scheduler.acquire(hog, i, {1: host}, last_executor=None, gpus=GPUS_PER_HOST)
        for i, host in enumerate(sorted(cluster.gpus.agents))
    ]
    waits = lambda: eventually(lambda: any(k == b.kernel_id for k, _ in scheduler.waiting()))  # noqa: E731
    try:
        result = await interrupted(b, "print('never')", waits)
    finally:
        for grant in hogs:
            await scheduler.release(grant)
    assert result.error is not None and "interrupted while it waited" in result.error[1]
    assert wait_statuses(result.outputs)[-1][0] == "not started"
    assert "never" not in result.stdout and not scheduler.waiting()
    assert (await b.execute("print('on')")).stdout == "on\n"


async def test_a_crashed_executor_and_a_shut_down_kernel_give_everything_back(
    cluster: LocalCluster, flag: Path
) -> None:
    before = subscribed(cluster)
    c = await cluster.start_kernel(gpus=1)
    assert subscribed(cluster) == [n + 1 for n in before]  # one GPU on each of 3 hosts
    first = await c.execute("import torch\nt = torch.ones(2)")
    # Its tensors stay resident on the one device it used.
    ((resident_host, resident),) = held_on_agents(cluster, c.kernel_id).items()
    assert resident_host == host_of(c, first) and len(resident) == 1
    async with anyio.create_task_group() as tg:
        results: list[ExecuteResult] = []

        async def run() -> None:
            results.append(await c.execute(hold_until(flag)))

        tg.start_soon(run)
        grant = await running(cluster, c)
        await c.kill_replica(grant.replica)
    (lost,) = results
    assert lost.error is not None and lost.error[0] == "CellLostError"
    # Shown as the cell's error output too, as a notebook renders it.
    errors = [o["content"] for o in lost.outputs if o["msg_type"] == "error"]
    assert [e["ename"] for e in errors] == ["CellLostError"] and errors[0]["traceback"]
    await eventually(lambda: grant.host not in held_on_agents(cluster, c.kernel_id))
    assert not grants_of(cluster, c)
    again = await c.execute("print(t.sum().item())")
    assert again.stdout == "2.0\n" and host_of(c, again) != grant.host  # a survivor ran it

    await c.shutdown()
    # The other kernels' subscriptions are left, and nothing of c on any host.
    await eventually(lambda: subscribed(cluster) == before)
    await eventually(lambda: not held_on_agents(cluster, c.kernel_id))


async def test_everything_is_idle_once_the_kernels_are_shut_down(
    cluster: LocalCluster, a: Kernel, b: Kernel
) -> None:
    await a.shutdown()
    await b.shutdown()
    await eventually(lambda: subscribed(cluster) == [0, 0, 0])
    await eventually(cluster.gpus.idle)


async def test_a_replacement_replica_runs_cells_with_its_new_hosts_gpus() -> None:
    async with virtual_cluster(hosts=4, gpus_per_host=1, replace=True) as c:
        k = await c.start_kernel(gpus=1)
        first = await k.execute("import torch\nt = torch.ones(3)")
        assert first.executor is not None
        await k.kill_replica(first.executor)

        # The replica is replaced on the one free host, and its subscription moves there
        # (from the moment the replacement starts there: it joins the kernel later).
        def replaced() -> bool:
            joined = any(r.alive and r.host == "host-4" for r in k.replicas)
            return joined and subscribed(c) == [0, 1, 1, 1]

        await eventually(replaced, timeout=60)
        (new,) = [r for r in k.replicas if r.alive and r.host == "host-4"]
        # The other replicas' hosts are busy: the cell can run only on the new one.
        scheduler = c.gpus.scheduler
        hog = KernelId("test-hog")
        others = [r.host for r in k.replicas if r.alive and r.node != new.node]
        hogs = [
            await scheduler.acquire(hog, i, {1: h}, last_executor=None, gpus=1)
            for i, h in enumerate(others)
        ]
        result = await k.execute("from nbos.gpu import devices\nprint(devices(), t.sum().item())")
        for grant in hogs:
            await scheduler.release(grant)
        assert (result.executor, result.stdout) == (new.node, "(0,) 3.0\n")
        await k.shutdown()
        await eventually(lambda: c.gpus.idle() and subscribed(c) == [0, 0, 0, 0])


async def test_a_user_policy_registered_by_entry_point_places_the_kernels(
    installed_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the cluster's process needs the policy: replicas never place anything.
    monkeypatch.syspath_prepend(str(installed_policy))
    async with virtual_cluster(hosts=4, placement_policy="spread-by-name") as c:
        module = sys.modules["nbos_example_policy"]
        assert Path(str(module.__file__)).is_relative_to(installed_policy)
        kernel = await c.start_kernel()
        own = load_policy("spread-by-name").place(
            PlacementRequest(KernelId(kernel.kernel_id), 0, 3), c.gpus.scheduler.view()
        )
        assert tuple(r.host for r in kernel.replicas) == tuple(own)
        assert (await kernel.execute("print(1)")).stdout == "1\n"
