"""Admission control of ``nbos gateway``: a flood of kernel starts, over HTTP and the control
API at once, against a gateway that runs at most 2 starts at once (issue 27, item 4)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import zmq
import zmq.asyncio

from nbos.core.errors import ConfigError, OverloadedError
from nbos.core.identity import User
from nbos.gateway._admission import StartAdmission
from nbos.gateway.auth import Authenticator
from nbos.gateway.control_api import (
    ControlError,
    ControlReply,
    ControlRequest,
    KernelInfo,
    KernelList,
    ShutdownKernel,
    StartKernel,
    serve_control,
)
from nbos.jupyter.host import start_kernel
from nbos.transport.ports import free_loopback_ports
from tests.agent._daemons import DEADLINE
from tests.gateway._http import KernelSocket, call, start_http_gateway, stdout, stop
from tests.gateway._service import ask

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

TOKEN = "admission-secret"
#: Requests fired at once: far more than the 2 starts the gateway runs at once.
HTTP_FLOOD = 40
CONTROL_FLOOD = 6
#: Clients of the HTTP flood that ask again after ``Retry-After`` until they get a kernel.
PATIENT = 2


def replicas_of(root: Path) -> dict[int, str]:
    """The replica processes started under ``root`` (the gateway's data directory): pid ->
    command line. Scanned in ``/proc``, so a replica nobody knows of is seen too."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        if "nbos.kernel.replica" in argv and str(root) in argv:
            found[int(entry)] = argv.replace("\0", " ")
    return found


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    (control,) = free_loopback_ports(1)
    extra = {
        "NBOS_GATEWAY__MAX_STARTING": "2",
        # Refused at once, not after a wait for a slot: the flood must meet refusals.
        "NBOS_GATEWAY__START_WAIT_S": "0",
        "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
    }
    process, url, log = start_http_gateway(tmp_path, TOKEN, extra)
    yield url, f"127.0.0.1:{control}", log
    stop(process)


async def test_a_flood_of_starts_is_refused_at_once_and_hurts_no_kernel(
    gateway: tuple[str, str, Path], tmp_path: Path
) -> None:
    url, control, log = gateway
    kernels = f"{url}/api/kernels"
    with anyio.fail_after(4 * DEADLINE):
        # As a client would: a 503 (a host that did not answer in time on a loaded
        # machine) is asked again.
        while (answer := await call(kernels, "POST", {}, token=TOKEN))[0] == 503:  # noqa: ASYNC110
            await anyio.sleep(1)
    code, first = answer
    assert code == 201, first
    ws = await KernelSocket.open(f"{kernels}/{first['id']}/channels", TOKEN)
    try:
        assert (await ws.run("x = 7"))[0]["content"]["status"] == "ok"

        headers = {"Authorization": f"token {TOKEN}"}
        limits = httpx.Limits(max_connections=HTTP_FLOOD)
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=4 * DEADLINE) as http:
            responses: list[httpx.Response] = []
            replies: list[ControlReply] = []
            patient: list[httpx.Response] = []

            async def post() -> None:
                responses.append(await http.post(kernels, json={}))

            async def post_until_started() -> None:
                while (answer := await http.post(kernels, json={})).status_code == 503:
                    responses.append(answer)
                    await anyio.sleep(int(answer.headers["Retry-After"]))
                patient.append(answer)

            async def start() -> None:
                replies.append(await ask(control, StartKernel()))

            with anyio.fail_after(8 * DEADLINE):
                async with anyio.create_task_group() as tg:
                    for _ in range(PATIENT):
                        tg.start_soon(post_until_started)
                    for _ in range(HTTP_FLOOD - PATIENT):
                        tg.start_soon(post)
                    for _ in range(CONTROL_FLOOD):
                        tg.start_soon(start)

            codes = Counter(r.status_code for r in responses)
            # Started, or refused with when to ask again: never a failure (a 500).
            assert set(codes) <= {201, 503}, [r.text for r in responses if r.status_code > 503]
            refused = [r for r in responses if r.status_code == 503]
            assert refused, f"all {HTTP_FLOOD} started at once: nothing was refused ({codes})"
            for r in refused:
                assert int(r.headers["Retry-After"]) >= 1, r.headers
                assert "kernels are starting" in r.json()["message"], r.text
            # A client that asks again after Retry-After gets its kernel.
            assert [r.status_code for r in patient] == [201] * PATIENT, [r.text for r in patient]
            started = [r.json()["id"] for r in [*responses, *patient] if r.status_code == 201]
            for reply in replies:
                assert isinstance(reply, KernelInfo) or (
                    isinstance(reply, ControlError)
                    and reply.kind == "overloaded"
                    and reply.retry_after_s is not None
                    and reply.retry_after_s >= 1
                ), reply
            by_control = [r.kernel_id for r in replies if isinstance(r, KernelInfo)]

            # The kernel that ran before the flood still runs, with its state.
            reply, outputs = await ws.run("print(x)")
            assert reply["content"]["status"] == "ok" and stdout(outputs) == "7\n"

            for kernel_id in started:
                assert (await http.delete(f"{kernels}/{kernel_id}")).status_code == 204
        for kernel_id in by_control:
            assert isinstance(await ask(control, ShutdownKernel(kernel_id)), KernelList)
        reply, outputs = await ws.run("print(x * 6)")
        assert stdout(outputs) == "42\n"
    finally:
        ws.close()

    # What runs now is the first kernel's 3 replicas, and nothing else: no replica of a
    # start refused, failed or shut down outlived it.
    def others() -> dict[int, str]:
        return {p: a for p, a in replicas_of(tmp_path).items() if first["id"] not in a}

    with anyio.fail_after(DEADLINE):
        while others():  # noqa: ASYNC110  (other processes' ends: nothing signals them here)
            await anyio.sleep(0.2)
    assert len(replicas_of(tmp_path)) == 3, replicas_of(tmp_path)
    assert (await call(f"{kernels}/{first['id']}", "DELETE", token=TOKEN))[0] == 204
    with anyio.fail_after(DEADLINE):
        while replicas_of(tmp_path):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    assert "Traceback" not in log.read_text()


async def test_the_kernelspecs_kernel_host_asks_again_after_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control endpoint answers an overloaded start with ``ControlError(overloaded,
    retry_after_s)``; the kernel host of the ``nbos`` kernelspec waits that long (and up to
    half again) and asks again, and gets its kernel."""
    asked: list[float] = []
    monkeypatch.setenv("NBOS_TOKEN", "t")  # the kernel host's token, as a user would set it

    async def handle(user: User, request: ControlRequest) -> ControlReply:
        asked.append(anyio.current_time())
        if len(asked) == 1:
            raise OverloadedError("2 kernels are starting, the most at once", 1.0)
        return KernelInfo("k1", {}, [])

    (port,) = free_loopback_ports(1)
    socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    socket.bind(f"tcp://127.0.0.1:{port}")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_control, socket, handle, Authenticator("t").authenticate)
            refused = await ask(f"127.0.0.1:{port}", StartKernel())
            assert isinstance(refused, ControlError), refused
            assert (refused.kind, refused.retry_after_s) == ("overloaded", 1.0)
            asked.clear()
            with anyio.fail_after(DEADLINE):
                reply = await start_kernel(f"127.0.0.1:{port}", StartKernel())
            assert isinstance(reply, KernelInfo) and reply.kernel_id == "k1"
            assert len(asked) == 2 and asked[1] - asked[0] >= 1.0
            tg.cancel_scope.cancel()
    finally:
        socket.close(0)


async def test_a_start_waits_at_most_start_wait_s_for_a_slot() -> None:
    admission = StartAdmission(1, wait_s=0.5)
    with admission.slot():
        began = anyio.current_time()
        with pytest.raises(OverloadedError, match="1 kernels are starting"):
            await admission.wait()
        assert anyio.current_time() - began >= 0.5  # it waited, then was refused

    async def end_soon() -> None:
        with admission.slot():
            await anyio.sleep(0.1)

    admission.wait_s = 60.0
    async with anyio.create_task_group() as tg:
        tg.start_soon(end_soon)
        await anyio.sleep(0.01)
        assert admission.running == 1
        await admission.wait()  # the slot that ended is this start's
        assert admission.running == 0
    with pytest.raises(ConfigError):
        StartAdmission(1, wait_s=float("nan"))


async def test_a_refused_start_asks_again_once_the_oldest_start_is_due_to_end() -> None:
    """Not after the whole time a start takes: in a burst that left slots empty for
    seconds, every refused client asleep."""
    admission = StartAdmission(1)
    whole = admission.retry_after_s()  # nothing runs: the time a start takes
    with admission.slot():
        await anyio.sleep(2.1)
        with pytest.raises(OverloadedError) as refused:
            admission.check()
    assert refused.value.retry_after_s <= whole - 2, (whole, refused.value.retry_after_s)
    assert refused.value.retry_after_s >= 1
