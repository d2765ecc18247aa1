"""A real JupyterHub whose users' single-user servers take their kernels from nbos.

One ``nbos gateway --http`` (3 local hosts) with ``[auth] jupyterhub_api_url`` pointed
at a real Hub; the Hub's single-user servers (``jupyterhub-singleuser``, spawned as the
Hub's own user by ``SimpleLocalProcessSpawner``) run with ``--gateway-url`` to that
gateway, each sending its own ``JUPYTERHUB_API_TOKEN`` (the spawner's ``api_token``) as
``JUPYTER_GATEWAY_AUTH_TOKEN``: the lines ``docs/jupyter.md`` gives, read from it. Each user,
with their own Hub token and through the Hub's proxy, starts a kernel on their server,
runs cells on it and lists kernels: each runs as themselves and sees only their own. Had
the servers shared one token, both kernels would be that token's user's, and both lists
would hold both.

Sizes: ``NBOS_JUPYTERHUB_USERS`` users (at least 2; alice, bob, then user2, ...),
``NBOS_JUPYTERHUB_CELLS`` cells each.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests._servers._process import free_port, serve_or_skip
from tests._servers.jupyterhub import JupyterHub, start_jupyterhub
from tests.agent._daemons import ROOT
from tests.gateway._http import KernelSocket, call, start_http_gateway, stdout, stop

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900), pytest.mark.long]

USERS = (
    "alice",
    "bob",
    *(f"user{i}" for i in range(2, int(os.environ.get("NBOS_JUPYTERHUB_USERS", "2")))),
)
CELLS = int(os.environ.get("NBOS_JUPYTERHUB_CELLS", "3"))
#: The gateway's operator token: an admin, who sees every user's kernels.
OPERATOR_TOKEN = "hub-gateway-operator"
DOCS = ROOT / "docs" / "jupyter.md"
DOCUMENTED_GATEWAY = "http://gateway.example:8888"
#: Generous: a busy 2-core machine starts a Hub, servers, and three replicas a kernel.
DEADLINE_S = 180.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def documented_config(gateway_url: str) -> str:
    """The ``jupyterhub_config.py`` lines of ``docs/jupyter.md``, for this gateway."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M)
    (block,) = [b for b in blocks if "spawner.api_token" in b]
    assert DOCUMENTED_GATEWAY in block
    return block.replace(DOCUMENTED_GATEWAY, gateway_url)


def hub_config(gateway_url: str, homes: Path) -> str:
    """The documented lines, and what this machine needs besides (servers that run as the
    Hub's user, root here, under this Python)."""
    return (
        documented_config(gateway_url)
        + f"""
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = "{homes}/{{username}}"
c.Spawner.cmd = [{sys.executable!r}, "-m", "jupyterhub.singleuser"]
c.Spawner.args = [
    "--ServerApp.allow_root=True",
    # A replicated kernel starts slower than a local one on a busy machine.
    "--GatewayClient.request_timeout=120",
    "--GatewayClient.connect_timeout=60",
]
c.Spawner.start_timeout = {int(DEADLINE_S)}
c.Spawner.http_timeout = {int(DEADLINE_S)}
"""
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The gateway's URL, and the port its Hub is to have."""
    hub_port = free_port()
    process, url, log = start_http_gateway(
        tmp_path_factory.mktemp("gateway"),
        OPERATOR_TOKEN,
        {
            "NBOS_AUTH__JUPYTERHUB_API_URL": f"http://127.0.0.1:{hub_port}/hub/api",
            "NBOS_CLUSTER__GPUS_PER_HOST": "1",
        },
    )
    yield url, hub_port
    stop(process)
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def hub(gateway: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    url, hub_port = gateway
    tmp = tmp_path_factory.mktemp("hub")
    config = hub_config(url, tmp / "homes")
    yield from serve_or_skip(
        lambda: start_jupyterhub(tmp, users=USERS, config=config, hub_port=hub_port),
        "a JupyterHub",
    )


async def _start_kernel_and_run_cells(server: str, token: str) -> tuple[str, list[str]]:
    """Start a kernel on ``server`` (a single-user server, as its user); its id, and what
    each cell printed: the kernel's user and the cell's number."""
    code, model = await call(f"{server}/api/kernels", "POST", {"name": "nbos"}, token=token)
    assert code == 201, model
    kernel_id = str(model["id"])
    socket = await KernelSocket.open(f"{server}/api/kernels/{kernel_id}/channels", token)
    printed = []
    try:
        for cell in range(CELLS):
            source = f"import os\nprint(os.environ.get('KERNEL_USERNAME'), {cell} * 7)"
            reply, outputs = await socket.run(source, timeout=DEADLINE_S)
            assert reply["content"]["status"] == "ok", reply["content"]
            printed.append(stdout(outputs))
    finally:
        socket.close()
    return kernel_id, printed


async def _kernel_ids(server: str, token: str) -> set[str]:
    code, kernels = await call(f"{server}/api/kernels", token=token)
    assert code == 200, kernels
    return {str(k["id"]) for k in kernels}


async def test_each_hub_user_runs_cells_on_nbos_as_themselves_and_sees_only_their_kernels(
    gateway: tuple[str, int], hub: JupyterHub
) -> None:
    gateway_url = gateway[0]
    begun = time.monotonic()
    tokens = {user: hub.new_token(user)[0] for user in USERS}
    servers = {user: hub.start_server(user, DEADLINE_S) for user in USERS}

    kernels: dict[str, str] = {}
    async with anyio.create_task_group() as tg:
        for user in USERS:

            async def run(user: str = user) -> None:
                kernel_id, printed = await _start_kernel_and_run_cells(servers[user], tokens[user])
                # KERNEL_USERNAME is whom the gateway authenticated.
                assert printed == [f"{user} {cell * 7}\n" for cell in range(CELLS)]
                kernels[user] = kernel_id

            tg.start_soon(run)
    assert len(set(kernels.values())) == len(USERS)

    for user in USERS:
        # Their own kernel and no one else's, through their server and at the gateway
        # itself with their Hub token: one token shared by the servers fails here.
        assert await _kernel_ids(servers[user], tokens[user]) == {kernels[user]}
        assert await _kernel_ids(gateway_url, tokens[user]) == {kernels[user]}
        for other in set(USERS) - {user}:
            code, _ = await call(f"{gateway_url}/api/kernels/{kernels[other]}", token=tokens[user])
            assert code == 404, f"{user} reached {other}'s kernel"
    # The gateway's operator (an admin) sees them all.
    assert await _kernel_ids(gateway_url, OPERATOR_TOKEN) == set(kernels.values())

    for user in USERS:
        kernel = f"{servers[user]}/api/kernels/{kernels[user]}"
        assert (await call(kernel, "DELETE", token=tokens[user]))[0] == 204
        assert await _kernel_ids(servers[user], tokens[user]) == set()
        hub.stop_server(user)
    print(f"{len(USERS)} Hub users, {CELLS} cells each: {time.monotonic() - begun:.1f} s")
