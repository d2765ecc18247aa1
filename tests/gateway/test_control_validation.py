"""Bad control requests against a real ``nbos gateway``: each is answered with
``ControlError`` naming its field, and the gateway, its kernels and their state go on.

Issue 27: one ``WatchKernel(id, wait_s=NaN)`` or ``DigestRequest(id, timeout_s=NaN)`` raised
``ValueError: deadline must not be NaN`` out of the control endpoint, and the gateway
exited, shutting every kernel down and saving an empty state.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from nbos.core.identity import User
from nbos.gateway.auth import OPERATOR, Authenticator
from nbos.gateway.control_api import (
    MAX_REQUEST_BYTES,
    ControlError,
    ControlReply,
    ControlRequest,
    DigestRequest,
    KernelInfo,
    KernelList,
    ListKernels,
    RestartReplica,
    SignalReplica,
    StartKernel,
    WatchKernel,
    serve_control,
)
from nbos.transport.ports import free_loopback_ports
from tests.gateway._http import stop
from tests.gateway._service import ask, ask_raw, control_gateway, run_cell, status_when

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    process, address, log = control_gateway(tmp_path)
    yield process, address, log
    stop(process)


def _bad_requests(kernel_id: str) -> list[tuple[ControlRequest, str]]:
    """Requests whose one bad field (a struct built here is not checked: decoding is)
    must be named in the answer."""
    return [
        (WatchKernel(kernel_id, wait_s=NAN), "wait_s"),
        (DigestRequest(kernel_id, timeout_s=NAN), "timeout_s"),
        (WatchKernel(kernel_id, wait_s=INF), "wait_s"),
        (WatchKernel(kernel_id, wait_s=-1.0), "wait_s"),
        (DigestRequest(kernel_id, timeout_s=INF), "timeout_s"),
        (DigestRequest(kernel_id, timeout_s=-INF), "timeout_s"),
        (DigestRequest(kernel_id, timeout_s=0.0), "timeout_s"),
        (DigestRequest(kernel_id, after=-1), "after"),
        (RestartReplica(kernel_id, 1, timeout_s=NAN), "timeout_s"),
        (RestartReplica(kernel_id, 0), "node"),
        (SignalReplica(kernel_id, 2**40, 18), "node"),
        (SignalReplica(kernel_id, 1, -9), "signal"),
        (SignalReplica(kernel_id, 1, 0), "signal"),
        (StartKernel(lease_s=NAN), "lease_s"),
        (StartKernel(lease_s=INF), "lease_s"),
        (StartKernel(lease_s=-5.0), "lease_s"),
        (StartKernel(gpus=-1), "gpus"),
        (StartKernel(gpus=10**12), "gpus"),
        (StartKernel(connection={"key": "k" * 300}), "connection"),
        (StartKernel(connection={f"port_{i}": 1 for i in range(17)}), "connection"),
        (StartKernel(connection={"shell_port": 70000, "key": "k"}), "connection"),
        (WatchKernel("k" * 1000), "kernel_id"),
        (WatchKernel(""), "kernel_id"),
    ]


async def test_bad_fields_get_control_error_and_the_gateway_and_its_kernels_go_on(
    gateway: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, address, log = gateway
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    target = await ask(address, StartKernel())
    other = await ask(address, StartKernel())
    assert isinstance(target, KernelInfo) and isinstance(other, KernelInfo)
    assert await run_cell(target, "x = 40") == {"status": "ok", "stdout": ""}
    assert await run_cell(other, "y = [1, 2]") == {"status": "ok", "stdout": ""}

    encode = msgspec.msgpack.encode
    for request, field in _bad_requests(target.kernel_id):
        answer = await ask_raw(address, encode(request))
        assert isinstance(answer, ControlError), (request, answer, log.read_text()[-3000:])
        assert answer.kind == "malformed", (request, answer)
        assert f"$.request.{field}" in answer.message, (request, answer)

    # A string that is not UTF-8: msgspec raises UnicodeDecodeError, no DecodeError.
    not_utf8 = encode({"t": "WatchKernel", "kernel_id": b"\xed\xa0\x80"}).replace(
        b"\xc4\x03", b"\xa3"
    )
    answer = await ask_raw(address, not_utf8)
    assert isinstance(answer, ControlError) and answer.kind == "malformed", answer
    for body in (b"", b"\xc1", encode({"t": "WatchKernel", "kernel_id": 5}), encode([1, 2])):
        answer = await ask_raw(address, body)
        assert isinstance(answer, ControlError) and answer.kind == "malformed", (body, answer)

    # A message over the limit is dropped with its connection before it is read.
    huge = encode(WatchKernel(target.kernel_id + " " * MAX_REQUEST_BYTES))
    assert await ask_raw(address, huge, timeout=10.0) is None

    assert process.poll() is None, log.read_text()[-3000:]
    listed = await ask(address, ListKernels())
    assert isinstance(listed, KernelList)
    assert {k.kernel_id: k.replicas for k in listed.kernels} == {
        target.kernel_id: target.replicas,
        other.kernel_id: other.replicas,
    }
    assert await run_cell(other, "print(y)") == {"status": "ok", "stdout": "[1, 2]\n"}
    assert await run_cell(target, "print(x + 2)") == {"status": "ok", "stdout": "42\n"}
    watched = await ask(address, WatchKernel(target.kernel_id, wait_s=0.0))
    assert isinstance(watched, KernelInfo) and watched.kernel_id == target.kernel_id


async def test_a_request_failing_with_any_exception_is_answered_and_the_endpoint_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler stands for a bug of the gateway's: an exception no nbos error, as anyio's
    ``ValueError`` for a NaN deadline was. It fails its request only."""

    async def handle(user: User, request: ControlRequest) -> ControlReply:
        assert user == OPERATOR
        if isinstance(request, WatchKernel):
            raise ValueError("deadline must not be NaN")
        return KernelList([])

    (port,) = free_loopback_ports(1)
    socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    socket.bind(f"tcp://127.0.0.1:{port}")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_control, socket, handle, Authenticator("t").authenticate)
            with caplog.at_level(logging.ERROR, "nbos.gateway.control_api"):
                failed = await ask_raw(
                    f"127.0.0.1:{port}", msgspec.msgpack.encode(WatchKernel("k")), token="t"
                )
            listed = await ask_raw(
                f"127.0.0.1:{port}", msgspec.msgpack.encode(ListKernels()), token="t"
            )
            tg.cancel_scope.cancel()
    finally:
        socket.close(0)
    assert isinstance(failed, ControlError) and failed.kind == "failed", failed
    assert "ValueError: deadline must not be NaN" in failed.message
    assert listed == KernelList([])
    (record,) = [r for r in caplog.records if r.name == "nbos.gateway.control_api"]
    assert record.exc_info is not None and "WatchKernel" in record.getMessage()
