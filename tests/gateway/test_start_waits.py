"""A kernel start beyond the cluster's capacity waits for the host the autoscaler adds.

One host of two GPUs that takes one replica (``max_replicas_per_host = 1``), kernels of one
replica, the autoscaler allowed a second host: the first kernel takes the host, the
second waits for the host the autoscaler adds (its client sees it ``starting``, and why)
and then runs a cell; a third is refused at once with the ceiling named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from nbos.cli.status import as_json, render
from nbos.core.config import GatewaySettings, Settings
from nbos.core.errors import KernelError, OverloadedError
from nbos.core.identity import User
from nbos.gateway import Kernel, KernelManager, control_api
from nbos.gateway._dashboard import Dashboard, EventLog
from nbos.gateway.auth import Authenticator
from nbos.gateway.control_api import (
    ClusterStatus,
    ControlError,
    KernelInfo,
    KernelList,
    ListKernels,
    ShutdownKernel,
    StartKernel,
    WatchKernel,
    start_kernel,
)
from nbos.gateway.http import DashboardSources, serve_http
from nbos.gateway.service import GatewayService
from tests.agent._daemons import DEADLINE
from tests.gateway._http import (
    KernelSocket,
    call,
    poll,
    start_http_gateway,
    start_jupyter_server,
    stdout,
    stop,
)
from tests.gateway._service import local_settings, run_cell

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

HTTP = GatewaySettings(http_address="127.0.0.1:0")


def one_host_growing_to_two(tmp_path: Path) -> Settings:
    settings = local_settings(
        tmp_path,
        autoscale=True,
        min_hosts=1,
        max_hosts=2,
        autoscale_period_s=0.3,
        scale_out_cooldown_s=0.0,
        scale_in_cooldown_s=0.0,
        idle_grace_s=600.0,
    )
    cluster = msgspec.structs.replace(
        settings.cluster, hosts=1, replicas_per_kernel=1, max_replicas_per_host=1
    )
    return msgspec.structs.replace(settings, cluster=cluster)


async def test_a_start_waits_for_the_host_the_autoscaler_adds_and_the_ceiling_refuses(
    tmp_path: Path,
) -> None:
    async with GatewayService.serve(
        one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        manager = service.kernel_manager
        scheduler = service.directory.scheduler
        firsts: list[Kernel] = []
        waits: list[str] = []

        async def start_first() -> None:
            firsts.append(await manager.start_kernel(gpus=1))

        # The second start is asked once the first is placed, while it still starts: the
        # one host is full from then on, and only the second start's wait has the
        # autoscaler add a host.
        async with anyio.create_task_group() as tg:
            tg.start_soon(start_first)
            with anyio.fail_after(DEADLINE):
                while not any(h.replicas for h in scheduler.view().hosts):
                    await scheduler.changed(scheduler.version)
            second = await manager.start_kernel(gpus=1, on_wait=waits.append)
        (first,) = firsts
        assert len(waits) == 1 and waits[0].startswith("waiting for a host"), waits
        assert {r.host for r in second.replicas}.isdisjoint(r.host for r in first.replicas)
        assert service.directory.scheduler.ledger.scale_outs >= 1
        assert not manager.starts_waiting
        assert (await second.execute("%%gpus 1\nprint(6 * 7)")).stdout == "42\n"
        with pytest.raises(OverloadedError, match=r"ceiling \(max_hosts=2\)"):
            await manager.start_kernel(gpus=1)


async def _first_placed(manager: KernelManager, tg: anyio.abc.TaskGroup) -> list[Kernel]:
    """Start a kernel of one GPU in ``tg``; once it is placed (the one host is full from
    then on, and it still starts): the list that will hold it."""
    firsts: list[Kernel] = []
    scheduler = manager.gpus.scheduler

    async def start_first() -> None:
        firsts.append(await manager.start_kernel(gpus=1))

    tg.start_soon(start_first)
    with anyio.fail_after(DEADLINE):
        while not any(h.replicas for h in scheduler.view().hosts):
            await scheduler.changed(scheduler.version)
    return firsts


async def test_the_control_api_answers_a_waiting_start_early_and_lists_it(
    tmp_path: Path,
) -> None:
    async with GatewayService.serve(
        one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        address = service.addresses["control"]
        told: list[str] = []
        started: list[Any] = []

        async def start_second() -> None:
            started.append(await start_kernel(address, StartKernel(gpus=1), on_wait=told.append))

        async with anyio.create_task_group() as tg:
            await _first_placed(service.kernel_manager, tg)
            tg.start_soon(start_second)
            # While the second start waits for its host, the list (asked for) and the
            # dashboard show it.
            board = Dashboard(service.kernel_manager, service.host_status, EventLog(), dict)
            with anyio.fail_after(DEADLINE):
                while not (listed := await _starts_listed(address)) or not (  # noqa: ASYNC110
                    rows := [k for k in board.board(0)["kernels"] if k["waiting"]]
                ):
                    await anyio.sleep(0.05)
            (waiting,) = listed
            assert [(r["nbos_id"], r["state"], r["waiting"]) for r in rows] == [
                (waiting.kernel_id, "starting", waiting.waiting)
            ]
            plain = await control_api.call(address, ListKernels())
            assert isinstance(plain, KernelList)
            assert waiting.kernel_id not in {k.kernel_id for k in plain.kernels}
        assert waiting.waiting is not None and waiting.waiting.startswith("waiting for a host")
        assert (waiting.connection, waiting.replicas, waiting.gpus) == ({}, [], 1)
        (second,) = started
        assert told == [waiting.waiting], told
        assert isinstance(second, KernelInfo) and second.kernel_id == waiting.kernel_id
        assert second.state == "idle" and second.waiting is None, second
        assert (await run_cell(second, "%%gpus 1\nprint(6 * 7)"))["stdout"] == "42\n"
        refused = await start_kernel(address, StartKernel(gpus=1))
        assert isinstance(refused, ControlError) and refused.kind == "overloaded", refused
        assert "max_hosts=2" in refused.message


async def _starts_listed(address: str) -> list[KernelInfo]:
    listed = await control_api.call(address, ListKernels(starts=True))
    assert isinstance(listed, KernelList), listed
    return [k for k in listed.kernels if k.state == "starting" and k.waiting is not None]


async def test_a_waiting_start_shut_down_is_called_off_and_its_watch_says_so(
    tmp_path: Path,
) -> None:
    async with GatewayService.serve(
        one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        address = service.addresses["control"]
        manager = service.kernel_manager
        admin = User(name="operator", role="admin")
        async with anyio.create_task_group() as tg:
            await _first_placed(manager, tg)
            early = await control_api.call(address, StartKernel(gpus=1, early=True))
            assert isinstance(early, KernelInfo) and early.state == "starting", early
            assert early.waiting is not None and early.waiting.startswith("waiting for a host")
            # Shut down while it still waits (checked in the same step as the shutdown's).
            assert early.kernel_id in manager.starts_waiting
            rest = await service.handle(admin, ShutdownKernel(early.kernel_id))
        assert isinstance(rest, KernelList), rest
        assert early.kernel_id not in {k.kernel_id for k in rest.kernels}
        watched = await control_api.call(address, WatchKernel(early.kernel_id, 5.0))
        assert isinstance(watched, ControlError) and "shut down" in watched.message, watched
        assert not manager.starts and len(manager.kernels) == 1


async def test_a_start_not_running_within_its_timeout_is_called_off(tmp_path: Path) -> None:
    async with GatewayService.serve(
        one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        manager = service.kernel_manager
        async with anyio.create_task_group() as tg:
            await _first_placed(manager, tg)
            # Far less than a host takes to join: the start still waits for it then.
            late = r"still starts after 0\.05 s \(waiting for a host"
            with pytest.raises(KernelError, match=late):
                await start_kernel(service.addresses["control"], StartKernel(gpus=1), 0.05)
            assert not manager.starts_waiting
        assert not manager.starts and len(manager.kernels) == 1


async def test_a_full_host_is_no_reason_to_scale_out(tmp_path: Path) -> None:
    """The one host, full with one kernel's replica, is in service: no host is added for
    it (the autoscaler counted it as missing from its floor of one and added a second)."""
    async with GatewayService.serve(
        one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
    ) as service:
        scheduler = service.directory.scheduler
        await service.kernel_manager.start_kernel(gpus=1)
        assert scheduler.model.full_hosts()
        # Ten autoscaler periods and more, whatever the machine's load.
        autoscaler = scheduler.decisions.autoscaler
        assert autoscaler is not None
        decided = autoscaler.last_action_at
        await anyio.sleep(3.0)
        assert scheduler.ledger.scale_outs == 0 and autoscaler.last_action_at == decided
        assert len(scheduler.view().hosts) == 1


async def test_the_http_api_answers_a_waiting_start_at_once_and_its_websocket_waits(
    tmp_path: Path,
) -> None:
    async with (
        GatewayService.serve(
            one_host_growing_to_two(tmp_path), shutdown_kernels_on_exit=True
        ) as service,
        serve_http(
            HTTP,
            service.kernel_manager,
            lambda: 2,
            Authenticator("t"),
            DashboardSources(service.host_status, EventLog()),
        ) as api,
    ):
        kernels = f"{api.url}/api/kernels"
        scheduler = service.directory.scheduler
        taken: list[tuple[int, Any]] = []

        async def post_first() -> None:
            taken.append(await call(kernels, "POST", {}, token="t"))

        # As above: the second start is asked while the first one, placed, still starts.
        async with anyio.create_task_group() as tg:
            tg.start_soon(post_first)
            with anyio.fail_after(DEADLINE):
                while not any(h.replicas for h in scheduler.view().hosts):
                    await scheduler.changed(scheduler.version)
            status, model = await call(kernels, "POST", {}, token="t")
        ((first_status, first),) = taken
        assert first_status == 201 and first["execution_state"] == "idle", first
        assert status == 201, model
        assert model["execution_state"] == "starting", model
        assert model["nbos"]["waiting"].startswith("waiting for a host"), model
        # The kernel list and the dashboard show it waiting, and why.
        status, listed = await call(kernels, token="t")
        assert status == 200 and model["id"] in {k["id"] for k in listed}, listed
        (shown,) = [k for k in listed if k["id"] == model["id"]]
        assert shown["nbos"]["state"] == "starting" and shown["nbos"]["waiting"], shown
        status, board = await call(f"{api.url}/dashboard/api/state", token="t")
        (row,) = [k for k in board["board"]["kernels"] if k["id"] == model["id"]]
        # Placed meanwhile, it starts still, no longer waiting for a host.
        assert row["state"] == "starting" and row["waiting"] in (None, shown["nbos"]["waiting"])
        # The client connects and sends a cell at once: both wait for the kernel.
        ws = await KernelSocket.open(f"{kernels}/{model['id']}/channels", "t", v1=True)
        try:
            reply, outputs = await ws.run("print(6 * 7)", timeout=2 * DEADLINE)
            assert reply["content"]["status"] == "ok" and stdout(outputs) == "42\n"
        finally:
            ws.close()
        status, model = await call(f"{kernels}/{model['id']}", token="t")
        assert status == 200 and model["nbos"]["state"] == "idle", model
        status, refused = await call(kernels, "POST", {}, token="t")
        assert status == 503 and "max_hosts=2" in refused["message"], refused


@pytest.mark.long  # a gateway and a Jupyter Server, each a process of its own
async def test_jupyter_server_gets_a_waiting_start_within_its_request_timeout(
    tmp_path: Path,
) -> None:
    growing = {
        "NBOS_CLUSTER__HOSTS": "1",
        "NBOS_CLUSTER__REPLICAS_PER_KERNEL": "1",
        "NBOS_CLUSTER__MAX_REPLICAS_PER_HOST": "1",
        "NBOS_GATEWAY__AUTOSCALE": "true",
        "NBOS_GATEWAY__MIN_HOSTS": "1",
        "NBOS_GATEWAY__MAX_HOSTS": "2",
        "NBOS_GATEWAY__AUTOSCALE_PERIOD_S": "0.3",
        "NBOS_GATEWAY__SCALE_OUT_COOLDOWN_S": "0",
        "NBOS_GATEWAY__SCALE_IN_COOLDOWN_S": "0",
        "NBOS_GATEWAY__IDLE_GRACE_S": "600",
    }
    for place in ("gateway", "jupyter"):
        (tmp_path / place).mkdir()
    # Both wait for their servers with blocking clients: off the test's event loop.
    gateway, gateway_url, log = await anyio.to_thread.run_sync(
        start_http_gateway, tmp_path / "gateway", "g", growing
    )
    try:
        # Jupyter Server's own default: a start must be answered within 42 s.
        server, url, _ = await anyio.to_thread.run_sync(
            start_jupyter_server, tmp_path / "jupyter", gateway_url, "g", "j", 42.0
        )
        try:
            kernels = f"{url}/api/kernels"
            firsts: list[int] = []

            async def post_first() -> None:
                firsts.append((await call(kernels, "POST", {"name": "nbos-gpu-1"}, token="j"))[0])

            # The second start is asked once the first is placed (the gateway's log says
            # so): it waits for the host the autoscaler adds for it.
            async with anyio.create_task_group() as tg:
                tg.start_soon(post_first)
                await poll(lambda: _logged(log, "placed on"))
                code, model = await call(kernels, "POST", {"name": "nbos-gpu-1"}, token="j")
            assert firsts == [201]
            assert code == 201, model
            channels = f"{kernels}/{model['id']}/channels?token=j"
            ws = await KernelSocket.open(channels)
            try:
                reply, outputs = await ws.run("%%gpus 1\nprint(6 * 7)", timeout=2 * DEADLINE)
                assert reply["content"]["status"] == "ok" and stdout(outputs) == "42\n"
            finally:
                ws.close()
        finally:
            await anyio.to_thread.run_sync(stop, server)
    finally:
        await anyio.to_thread.run_sync(stop, gateway)
    assert "waiting for a host" in log.read_text()


async def _logged(log: Path, text: str) -> bool:
    return text in await anyio.Path(log).read_text()


class _OldStartKernel(msgspec.Struct, forbid_unknown_fields=True, tag="StartKernel", tag_field="t"):
    """``StartKernel`` as a gateway from before ``early`` decodes it."""

    gpus: int = 0
    connection: dict[str, str | int] | None = None
    lease_s: float | None = None
    user: str | None = None


class _OldKernelInfo(msgspec.Struct, forbid_unknown_fields=True, tag="KernelInfo", tag_field="t"):
    """``KernelInfo`` as a client from before ``waiting`` decodes it."""

    kernel_id: str
    connection: dict[str, str | int]
    replicas: list[Any]
    running_on: int | None = None
    last_executor: int | None = None
    last_exec_index: int = 0
    state: str | None = None
    owner: str = ""
    api_id: str | None = None
    gpus: int | None = None
    started_at: float | None = None


def test_peers_from_before_early_starts_decode_what_they_are_sent() -> None:
    encode = msgspec.msgpack.encode
    old_gateway = msgspec.msgpack.Decoder(_OldStartKernel)
    assert old_gateway.decode(encode(StartKernel(gpus=2, lease_s=5.0))).gpus == 2
    with pytest.raises(msgspec.ValidationError, match="early"):
        old_gateway.decode(encode(StartKernel(gpus=2, early=True)))
    old_client = msgspec.msgpack.Decoder(_OldKernelInfo)
    running = KernelInfo("k", {"shell_port": 1}, [], state="idle", owner="ann", gpus=1)
    assert old_client.decode(encode(running)).owner == "ann"
    with pytest.raises(msgspec.ValidationError, match="waiting"):
        old_client.decode(encode(KernelInfo("k", {}, [], state="starting", waiting="why")))


def test_status_shows_starts_and_its_json_every_field_the_wire_leaves_out() -> None:
    starting = KernelInfo("k", {}, [], state="starting", gpus=1, started_at=100.0, waiting="why")
    plain = json.loads(as_json(ClusterStatus([], [starting]), now=160.0))
    (kernel,) = plain["kernels"]
    assert kernel["running_on"] is None and kernel["last_exec_index"] == 0, kernel
    assert (kernel["owner"], kernel["api_id"], kernel["waiting"]) == ("", None, "why")
    assert kernel["age_s"] == 60.0 and "t" not in kernel
    text = render(ClusterStatus([], [starting]), now=160.0)
    assert "\nk why\n" in text and " starting " in text, text
