"""Users: two users' tokens on one real gateway (``nbos gateway --http`` with a users file and
metrics). Neither reaches the other's kernel through any endpoint (HTTP, WebSocket, control,
metrics), nor learns its key; a request without credentials is refused; an admin sees both."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import msgspec
import pytest

from nbos.core.identity import new_token
from nbos.gateway.auth import users_file_entry
from nbos.gateway.control_api import (
    ControlError,
    DigestRequest,
    KernelInfo,
    KernelList,
    ListKernels,
    RestartReplica,
    ShutdownCluster,
    ShutdownKernel,
    SignalReplica,
    StartKernel,
    StatusRequest,
    UsageRequest,
    WatchKernel,
    call,
    sealed,
)
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE
from tests.gateway._http import KernelSocket, start_http_gateway, stdout, stop
from tests.gateway._http import call as rest
from tests.gateway._service import ask_raw, run_cell

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


@attrs.frozen
class Cluster:
    control: str
    url: str
    metrics: str
    log: Path
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("users")
    tokens = {name: new_token() for name in ("alice", "bob", "carol")}
    users = tmp / "users.toml"
    users.write_text(
        users_file_entry("alice", tokens["alice"], quota=1)
        + users_file_entry("bob", tokens["bob"])
        + users_file_entry("carol", tokens["carol"], "admin")
    )
    (metrics,) = free_loopback_ports(1)
    operator = new_token()
    process, url, log = start_http_gateway(
        tmp,
        operator,
        {
            "NBOS_AUTH__USERS_FILE": str(users),
            "NBOS_GATEWAY__METRICS_ADDRESS": f"127.0.0.1:{metrics}",
        },
    )
    control = _control_address(log)
    yield Cluster(control, url, f"http://127.0.0.1:{metrics}/metrics", log, tokens)
    stop(process)
    text = log.read_text()
    for token in [operator, *tokens.values()]:
        assert token not in text  # no token is ever written to the log


def _control_address(log: Path) -> str:
    for line in log.read_text().splitlines():
        if "gateway: control at tcp://" in line:
            return line.split("control at tcp://")[1].split(",")[0]
    raise AssertionError(log.read_text())


async def _as(c: Cluster, user: str, request: Any) -> Any:
    return await call(c.control, request, timeout=DEADLINE, token=c.tokens[user])


def _metrics_status(c: Cluster, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(c.metrics, headers=headers), timeout=30):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_a_control_request_without_credentials_or_with_a_wrong_token_is_refused(
    cluster: Cluster,
) -> None:
    c = cluster
    bare = await ask_raw(c.control, b"\x81\xa1t\xabListKernels", token="")
    assert isinstance(bare, ControlError) and bare.kind == "unauthorized", bare
    assert "no credentials" in bare.message
    start = msgspec.msgpack.encode(StartKernel())
    for token in ("", "a-guess"):
        reply = await ask_raw(c.control, sealed(start, token), token="")
        assert isinstance(reply, ControlError) and reply.kind == "unauthorized", reply
    listed = await _as(c, "carol", ListKernels())
    assert isinstance(listed, KernelList) and listed.kernels == []  # nothing was started
    assert "control: StartKernel refused: unknown token" in c.log.read_text()


async def test_two_users_never_reach_each_others_kernels_and_an_admin_sees_both(
    cluster: Cluster,
) -> None:
    c = cluster
    a = await _as(c, "alice", StartKernel())
    b = await _as(c, "bob", StartKernel())
    assert isinstance(a, KernelInfo) and isinstance(b, KernelInfo), (a, b)
    assert (a.owner, b.owner) == ("alice", "bob")
    try:
        # Control: bob's view has no trace of alice's kernel, its key least of all.
        for request in (
            WatchKernel(a.kernel_id, 0.0),
            DigestRequest(a.kernel_id, timeout_s=5.0),
            ShutdownKernel(a.kernel_id),
        ):
            reply = await _as(c, "bob", request)
            assert isinstance(reply, ControlError) and reply.kind == "unknown", (request, reply)
        for request in (ListKernels(), StatusRequest()):
            seen = await _as(c, "bob", request)
            assert [k.kernel_id for k in seen.kernels] == [b.kernel_id], seen
            assert str(a.connection["key"]) not in repr(seen)
        for request in (
            SignalReplica(a.kernel_id, 1, int(signal.SIGKILL)),
            RestartReplica(a.kernel_id, 1),
            UsageRequest(),
            ShutdownCluster(),
        ):
            reply = await _as(c, "alice", request)
            assert isinstance(reply, ControlError) and reply.kind == "forbidden", (request, reply)
        admin = await _as(c, "carol", ListKernels())
        assert {k.kernel_id for k in admin.kernels} == {a.kernel_id, b.kernel_id}
        # Only an admin starts a kernel for somebody else (impersonation).
        refused = await _as(c, "alice", StartKernel(user="bob"))
        assert isinstance(refused, ControlError) and refused.kind == "forbidden", refused
        assert [k.kernel_id for k in (await _as(c, "bob", ListKernels())).kernels] == [b.kernel_id]
        # Alice's kernel lived through all of bob's tries.
        still = await _as(c, "alice", WatchKernel(a.kernel_id, 0.0))
        assert isinstance(still, KernelInfo) and all(r.alive for r in still.replicas), still
    finally:
        await _as(c, "carol", ShutdownKernel(a.kernel_id))
        await _as(c, "carol", ShutdownKernel(b.kernel_id))


async def test_http_and_websocket_show_each_user_their_own_kernels_only(cluster: Cluster) -> None:
    c = cluster
    kernels = f"{c.url}/api/kernels"
    alice, bob, carol = (c.tokens[n] for n in ("alice", "bob", "carol"))
    # A client's say-so is not who it is: KERNEL_USERNAME is the token's user.
    code, model = await rest(
        kernels, "POST", {"name": "nbos", "env": {"KERNEL_USERNAME": "bob"}}, token=alice
    )
    assert code == 201, model
    ka = model["id"]
    # An admin's KERNEL_USERNAME is who the kernel is for: bob's, bob sees it.
    env = {"KERNEL_USERNAME": "bob"}
    code, model = await rest(kernels, "POST", {"name": "nbos", "env": env}, token=carol)
    assert code == 201, model
    kb = model["id"]
    try:
        assert [k["id"] for k in (await rest(kernels, token=bob))[1]] == [kb]
        assert [k["id"] for k in (await rest(kernels, token=alice))[1]] == [ka]
        assert {k["id"] for k in (await rest(kernels, token=carol))[1]} == {ka, kb}
        one = f"{kernels}/{ka}"
        assert (await rest(one, token=bob))[0] == 404
        assert (await rest(f"{one}/interrupt", "POST", {}, token=bob))[0] == 404
        assert (await rest(f"{one}/restart", "POST", {}, token=bob))[0] == 404
        assert (await rest(one, "DELETE", token=bob))[0] == 404
        with pytest.raises(Exception, match="404"):
            await KernelSocket.open(f"{one}/channels", bob)
        sock = await KernelSocket.open(f"{one}/channels", alice)
        try:
            _, outputs = await sock.run("import os; print(os.environ['KERNEL_USERNAME'])")
            assert stdout(outputs).strip() == "alice"
        finally:
            sock.close()
        assert (await rest(one, token=alice))[0] == 200  # bob's tries left it alone
    finally:
        for kernel in (ka, kb):
            await rest(f"{kernels}/{kernel}", "DELETE", token=carol)


async def test_metrics_are_an_admins_once_there_are_users(cluster: Cluster) -> None:
    c = cluster
    assert _metrics_status(c, None) == 401
    assert _metrics_status(c, "a-guess") == 403
    assert _metrics_status(c, c.tokens["bob"]) == 403
    assert _metrics_status(c, c.tokens["carol"]) == 200


def _metrics(c: Cluster) -> str:
    headers = {"Authorization": f"Bearer {c.tokens['carol']}"}
    request = urllib.request.Request(c.metrics, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(response.read().decode())


async def test_a_users_cells_hold_gpus_as_theirs_and_show_in_their_figures(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Alice's cell's GPU is hers in the scheduler (what her quota counts) and in the
    per-user metrics; bob, who runs nothing, holds none."""
    c = cluster
    kernel = await _as(c, "alice", StartKernel(gpus=1))
    assert isinstance(kernel, KernelInfo), kernel
    go = tmp_path / "go"
    cell = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_cell, kernel, cell)
            with anyio.fail_after(DEADLINE):
                while 'nbos_user_gpus_committed{user="alice"} 1.0' not in _metrics(c):  # noqa: ASYNC110 (another process)
                    await anyio.sleep(0.2)
            text = _metrics(c)
            assert 'nbos_user_kernels{user="alice"} 1.0' in text
            bob = [line for line in text.splitlines() if line.startswith("nbos_user_gpus_com")]
            assert all(line.endswith(" 0.0") for line in bob if 'user="bob"' in line), bob
            go.touch()
        text = _metrics(c)
        seconds = [line for line in text.splitlines() if line.startswith("nbos_user_gpu_seconds")]
        alice = [line for line in seconds if 'user="alice"' in line and "_total" in line]
        assert alice and float(alice[0].split()[-1]) > 0, seconds
    finally:
        go.touch()
        await _as(c, "carol", ShutdownKernel(kernel.kernel_id))
