"""Nemeses that speak to the gateway's control port (and its HTTP API): a flood of
kernel starts, and malformed requests.

Both act on the gateway as any client may: what they send is what whoever reaches the
control address can send. The flood must hurt no kernel that exists, and every kernel
it got is shut down again; a malformed request must get ``ControlError`` and change
nothing, the gateway going on (``control-input``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import urllib.error
import urllib.request
from collections.abc import Sequence

import anyio
import attrs
import msgspec
import zmq
import zmq.asyncio

from nbos.chaos._checks import Violation
from nbos.chaos._nemesis import Strike
from nbos.chaos._target import Capability, ChaosKernel
from nbos.core.errors import ConfigError, KernelError, NemesisUnsupportedError, TransportError
from nbos.gateway.auth import client_token
from nbos.gateway.control_api import (
    ClusterStatus,
    ControlError,
    ControlReply,
    KernelInfo,
    KernelList,
    ListKernels,
    ShutdownKernel,
    StartKernel,
    StatusRequest,
    call,
    sealed,
)

log = logging.getLogger(__name__)

_CONTROL: frozenset[Capability] = frozenset({"gateway-control"})
#: How long a start of the flood may take to be answered (started or refused).
_START_TIMEOUT_S = 180.0
#: How long a malformed request may take to be refused.
_REFUSE_TIMEOUT_S = 15.0
_replies = msgspec.msgpack.Decoder(ControlReply)
_encode = msgspec.msgpack.Encoder().encode


def _check_starts(instance: StartFlood, attribute: object, value: int) -> None:
    if value < 1:
        raise ConfigError("starts", value, "at least 1")


@attrs.frozen
class HttpApi:
    """The gateway's Jupyter Kernel Gateway API: ``http://HOST:PORT`` and its token."""

    url: str
    token: str = ""

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(f"{self.url}{path}", data=body, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"token {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=_START_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    async def status_of_start(self) -> int:
        """``POST /api/kernels``: the HTTP status (0: no answer)."""
        try:
            status, _ = await anyio.to_thread.run_sync(self._request, "POST", "/api/kernels", b"{}")
        except OSError:
            return 0
        return status

    async def kernel_ids(self) -> list[str] | None:
        """``GET /api/kernels``: the API's kernels; ``None`` if it did not answer."""
        try:
            status, body = await anyio.to_thread.run_sync(self._request, "GET", "/api/kernels")
        except OSError:
            return None
        return [k["id"] for k in json.loads(body)] if status == 200 else None

    async def delete(self, kernel_id: str) -> None:
        try:
            status, body = await anyio.to_thread.run_sync(
                self._request, "DELETE", f"/api/kernels/{kernel_id}"
            )
        except OSError as exc:
            status, body = 0, str(exc).encode()
        if status != 204:
            log.warning("chaos: API kernel %s not deleted: %d %r", kernel_id, status, body[:200])


@attrs.frozen
class StartFlood:
    """``starts`` concurrent kernel starts mid-cell: ``StartKernel`` requests, and with
    ``http`` every other one a ``POST /api/kernels`` instead; then every kernel the flood
    created (acknowledged or not) is shut down. The gateway may refuse starts (HTTP 429
    or 503), but the kernels that exist must not suffer (``no-healthy-kernel-dead``)."""

    address: str | None = None
    starts: int = attrs.field(default=24, validator=_check_starts)
    http: HttpApi | None = None

    @property
    def name(self) -> str:
        return "start-flood"

    @property
    def needs(self) -> frozenset[Capability]:
        return _CONTROL

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        address = _given(self.address, self, kernel)
        before = await _kernel_ids(address)
        api_before = await self.http.kernel_ids() if self.http is not None else []
        if before is None or api_before is None:
            raise KernelError(f"the gateway at {address} does not list its kernels")
        replies: list[ControlReply | None] = []
        statuses: list[int] = []

        async def start(over_http: bool) -> None:
            if over_http:
                assert self.http is not None
                statuses.append(await self.http.status_of_start())
                return
            try:
                replies.append(await call(address, StartKernel(), timeout=_START_TIMEOUT_S))
            except TransportError:
                replies.append(None)

        async with anyio.create_task_group() as tg:
            for number in range(self.starts):
                tg.start_soon(start, self.http is not None and number % 2 == 1)
        target = f"{self.starts} starts: {_replies_told(replies)}"
        if self.http is not None:
            target = (
                f"{self.starts} starts: {len(replies)} StartKernel, {_replies_told(replies)}; "
                f"{len(statuses)} POST /api/kernels, {_statuses_told(statuses)}"
            )
        return await self._shut_down_new(address, before, api_before, target)

    async def _shut_down_new(
        self, address: str, before: Sequence[str], api_before: Sequence[str], target: str
    ) -> Strike:
        """Shut down every kernel listed now and not before; the strike, or ``gateway-down``."""
        if self.http is not None:
            api_after = await self.http.kernel_ids() or []
            for kernel_id in [k for k in api_after if k not in api_before]:
                await self.http.delete(kernel_id)
        after = await _kernel_ids(address)
        if after is None:
            down = Violation("gateway-down", "no kernel list after the flood")
            return Strike(target, (), found=(down,), checked=("control-input",))
        created = [k for k in after if k not in before]
        for kernel_id in created:
            await _shut_down(address, kernel_id)
        return Strike(f"{target}; {len(created)} more shut down", ())

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: the strike shut down what it started."""


def _replies_told(replies: Sequence[ControlReply | None]) -> str:
    started = sum(isinstance(r, KernelInfo) for r in replies)
    refused = sum(isinstance(r, ControlError) for r in replies)
    unanswered = len(replies) - started - refused
    return f"{started} started, {refused} refused, {unanswered} unanswered"


def _statuses_told(statuses: Sequence[int]) -> str:
    counts: dict[int, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{n}x {s or 'no answer'}" for s, n in sorted(counts.items()))


@attrs.frozen
class MalformedRequests:
    """Send the gateway's control port, in a drawn order, requests no client should send:
    bytes that do not decode, unknown tags, wrong types, unknown fields, and NaN,
    infinite, negative or oversized fields, several naming the kernel under test. Each
    must be refused with ``ControlError``; one that is accepted or unanswered is a
    ``control-input`` violation (a kernel one started is shut down), and a gateway that
    stops answering is ``gateway-down``."""

    address: str | None = None

    @property
    def name(self) -> str:
        return "malformed-requests"

    @property
    def needs(self) -> frozenset[Capability]:
        return _CONTROL

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        address = _given(self.address, self, kernel)
        requests = malformed_requests(kernel.kernel_id)
        rng.shuffle(requests)
        found: list[Violation] = []
        refused = sent = 0
        for label, body in requests:
            reply = await _send_raw(address, body)
            sent += 1
            if isinstance(reply, ControlError):
                refused += 1
                continue
            found.append(Violation("control-input", f"{label} was answered {_named(reply)}"))
            if isinstance(reply, KernelInfo):
                await _shut_down(address, reply.kernel_id)
            if not await _answers(address):
                found.append(Violation("gateway-down", f"no answer to a status after {label}"))
                break
        target = f"{refused} of {sent} malformed requests refused"
        if sent < len(requests):
            target += f", {len(requests) - sent} not sent (the gateway stopped answering)"
        return Strike(target, (), found=tuple(found), checked=("control-input",))

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: a request refused changed nothing."""


def malformed_requests(kernel_id: str) -> list[tuple[str, bytes]]:
    """(a label, the request's bytes) for each malformed request sent."""
    nan, inf = math.nan, math.inf
    bodies: list[tuple[str, object]] = [
        ("an unknown tag", {"t": "FormatDisk"}),
        ("a request without a tag", {"gpus": 1}),
        ("a list for a request", [1, 2, 3]),
        ("StartKernel gpus='two'", {"t": "StartKernel", "gpus": "two"}),
        ("StartKernel gpus=-1", {"t": "StartKernel", "gpus": -1}),
        ("StartKernel gpus=2**63", {"t": "StartKernel", "gpus": 2**63}),
        ("StartKernel lease_s=NaN", {"t": "StartKernel", "lease_s": nan}),
        ("StartKernel lease_s=-1", {"t": "StartKernel", "lease_s": -1.0}),
        ("StartKernel lease_s=inf", {"t": "StartKernel", "lease_s": inf}),
        (
            "StartKernel connection={'shell_port': -5}",
            {"t": "StartKernel", "connection": {"shell_port": -5}},
        ),
        ("StatusRequest with an unknown field", {"t": "StatusRequest", "all": True}),
        ("ShutdownKernel kernel_id=7", {"t": "ShutdownKernel", "kernel_id": 7}),
        ("ShutdownKernel without kernel_id", {"t": "ShutdownKernel"}),
    ]
    for field, request in (("wait_s", "WatchKernel"), ("timeout_s", "DigestRequest")):
        for shown, value in (("NaN", nan), ("inf", inf), ("-inf", -inf), ("-1", -1.0)):
            bodies.append(
                (f"{request} {field}={shown}", {"t": request, "kernel_id": kernel_id, field: value})
            )
    bodies += [
        ("DigestRequest after=-1", {"t": "DigestRequest", "kernel_id": kernel_id, "after": -1}),
        (
            "SignalReplica node=-1",
            {"t": "SignalReplica", "kernel_id": kernel_id, "node": -1, "signal": 0},
        ),
        (
            "SignalReplica signal=-9",
            {"t": "SignalReplica", "kernel_id": kernel_id, "node": 1, "signal": -9},
        ),
        (
            "SignalReplica signal=NaN",
            {"t": "SignalReplica", "kernel_id": kernel_id, "node": 1, "signal": nan},
        ),
        (
            "RestartReplica timeout_s=NaN",
            {"t": "RestartReplica", "kernel_id": kernel_id, "node": 1, "timeout_s": nan},
        ),
        # Past its field's bound, within MAX_REQUEST_BYTES (a larger message is dropped
        # unanswered with its connection, see nbos.gateway.control_api).
        ("WatchKernel kernel_id of 4 KiB", {"t": "WatchKernel", "kernel_id": "k" * 4096}),
    ]
    raw = [
        ("bytes that are not msgpack", b"\xc1\xff\x00"),
        ("an empty request", b""),
        ("a truncated map", b"\x82\xa1t"),
    ]
    return raw + [(label, _encode(body)) for label, body in bodies]


async def _send_raw(address: str, body: bytes) -> ControlReply | None:
    """The gateway's reply to ``body``, ``None`` if none came in time; a reply that does
    not decode is logged and counted as none."""
    socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address if address.startswith("tcp://") else f"tcp://{address}")
    try:
        await socket.send(sealed(body, client_token(address)))
        if not await socket.poll(int(_REFUSE_TIMEOUT_S * 1000)):
            return None
        data = await socket.recv()
    finally:
        socket.close()
    try:
        reply: ControlReply = _replies.decode(data)
    except msgspec.DecodeError:
        log.warning("chaos: the gateway's reply does not decode: %r", data[:200])
        return None
    return reply


async def _answers(address: str) -> bool:
    try:
        return isinstance(await call(address, StatusRequest(), timeout=30.0), ClusterStatus)
    except TransportError:
        return False


async def _kernel_ids(address: str) -> Sequence[str] | None:
    """The kernels the gateway lists; ``None`` if it did not answer with a list."""
    try:
        reply = await call(address, ListKernels(), timeout=60.0)
    except TransportError:
        return None
    return [k.kernel_id for k in reply.kernels] if isinstance(reply, KernelList) else None


async def _shut_down(address: str, kernel_id: str) -> None:
    """Shut down a kernel the nemesis got; a failure is logged (the kernel is listed on)."""
    try:
        reply = await call(address, ShutdownKernel(kernel_id), timeout=_START_TIMEOUT_S)
    except TransportError as exc:
        reply = ControlError("failed", str(exc))
    if isinstance(reply, ControlError):
        log.warning("chaos: kernel %s not shut down: %s", kernel_id, reply.message)


def _named(reply: ControlReply | None) -> str:
    return "nothing" if reply is None else type(reply).__name__


def _given(
    address: str | None, nemesis: StartFlood | MalformedRequests, kernel: ChaosKernel
) -> str:
    if address is None:
        raise NemesisUnsupportedError(nemesis.name, sorted(nemesis.needs), kernel.where)
    return address
