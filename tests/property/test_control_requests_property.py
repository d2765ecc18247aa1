"""Property: any control request, any field value of any type, raw msgpack or not, sent to a
real ``nbos gateway`` gets a reply; the gateway keeps serving and a kernel started before
is unchanged (its replicas alive, a cell still sees its variable).

One gateway for the module (3 local agents, no GPUs) and one protected kernel started
before the examples: each example is one request over a real ZeroMQ socket. Requests that
legitimately act on their kernel (``ShutdownKernel``, ``SignalReplica``, ``RestartReplica``)
never name the protected one, and a valid ``StartKernel`` is never sent: each would change a
kernel or start one (seconds of a busy machine per example), which is no bug.
``NBOS_PROPERTY_EXAMPLES`` sizes the run.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from nbos.gateway.auth import client_token
from nbos.gateway.control_api import (
    MAX_SECONDS,
    ControlError,
    ControlReply,
    DigestRequest,
    KernelInfo,
    KernelList,
    ListKernels,
    RestartReplica,
    ShutdownKernel,
    SignalReplica,
    StartKernel,
    WatchKernel,
    sealed,
)
from tests.agent._daemons import DEADLINE
from tests.gateway._http import stop
from tests.gateway._service import ask, control_gateway, run_cell, status_when
from tests.property._support import sized

pytestmark = pytest.mark.timeout(1800)

_replies = msgspec.msgpack.Decoder(ControlReply)

# --- values ----------------------------------------------------------------------------

#: Every integer msgpack carries, small ones (node ids, signals) often.
ints = st.one_of(st.integers(-2, 70), st.integers(min_value=-(2**63), max_value=2**64 - 1))
_SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 5e-324, 1e308]
#: NaN and both infinities included, short durations often.
floats = st.one_of(st.floats(0, 2), st.sampled_from(_SPECIAL), st.floats())
texts = st.one_of(st.text(max_size=20), st.text(min_size=100, max_size=400))
atoms = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=40))
#: A value of any type msgpack has: what a field of the wrong type gets.
anything = st.recursive(
    atoms,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=10,
)
#: A kernel id that names no kernel (an empty one, a long one ...).
strangers = texts
connections = st.dictionaries(texts, st.one_of(texts, ints), max_size=20)


def odd(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its type (odd values included), sometimes of any type."""
    return st.one_of(good, good, anything)


def quick_seconds() -> st.SearchStrategy[float]:
    """Durations for a request on the protected kernel: any but the valid ones above 1 s,
    which make a watch or digest legitimately wait that long."""
    return floats.filter(lambda s: not 1.0 < s <= MAX_SECONDS)


# --- requests --------------------------------------------------------------------------


def requests(protected: str) -> st.SearchStrategy[Any]:
    """Each request struct's fields (some left out, some unknown added) as msgpack maps."""
    ids = odd(strangers.filter(lambda k: k != protected))
    watched = st.one_of(ids, st.just(protected), st.just(protected))
    kinds: list[st.SearchStrategy[dict[str, Any]]] = [
        # gpus is always there and never 0: a valid start on these hosts (no GPUs) would
        # start a kernel; any gpus above 0 cannot be placed on them.
        _fields(
            "StartKernel",
            {"gpus": odd(ints.filter(lambda n: n != 0))},
            {"connection": odd(connections), "lease_s": odd(floats)},
        ),
        _fields("ListKernels", {}, {}),
        _fields("StatusRequest", {}, {}),
        _fields("UsageRequest", {}, {}),
        _fields("ShutdownKernel", {"kernel_id": ids}, {}),
        _fields("SignalReplica", {"kernel_id": ids}, {"node": odd(ints), "signal": odd(ints)}),
        _fields(
            "RestartReplica", {"kernel_id": ids}, {"node": odd(ints), "timeout_s": odd(floats)}
        ),
        _fields("WatchKernel", {"kernel_id": watched, "wait_s": odd(quick_seconds())}, {}),
        # timeout_s is always there: the default 30 s, per replica, for a cell not yet run.
        _fields(
            "DigestRequest",
            {"kernel_id": watched, "timeout_s": odd(quick_seconds())},
            {"after": odd(ints)},
        ),
    ]
    tagged = st.one_of(*kinds).map(msgspec.msgpack.encode)
    # Whole requests, which the mix above seldom draws: reads of the protected kernel with
    # odd numbers (issue 27's NaN watch), valid reads of it, acts on kernels that do not exist.
    stranger = strangers.filter(lambda k: k != protected)
    whole = st.one_of(
        st.builds(WatchKernel, st.just(protected), quick_seconds()),
        st.builds(DigestRequest, st.just(protected), st.one_of(st.none(), ints), quick_seconds()),
        st.builds(WatchKernel, st.just(protected), st.floats(0, 1)),
        st.builds(
            DigestRequest,
            st.just(protected),
            st.one_of(st.none(), st.integers(0, 3), st.integers(0, 2**63 - 1)),
            st.floats(1e-3, 1),
        ),
        st.builds(SignalReplica, stranger, st.integers(1, 3), st.sampled_from([9, 19])),
        st.builds(RestartReplica, stranger, st.integers(1, 3), st.floats(1e-3, 1)),
        st.builds(ShutdownKernel, stranger),
    ).map(msgspec.msgpack.encode)
    # A kernel id whose msgpack string is not UTF-8.
    not_utf8 = st.builds(
        lambda tag, junk: (
            b"\x82\xa1t"
            + msgspec.msgpack.encode(tag)
            + b"\xa9kernel_id"
            + bytes([0xD9, len(junk)])
            + junk
        ),
        st.sampled_from(["WatchKernel", "ShutdownKernel", "DigestRequest"]),
        st.binary(min_size=1, max_size=40),
    )
    untagged = st.one_of(
        st.dictionaries(st.sampled_from(["t", "kernel_id", "x"]), anything, max_size=3),
        st.builds(dict, t=texts, kernel_id=ids),  # an unknown request
        anything,
    ).map(msgspec.msgpack.encode)
    return st.one_of(*[tagged] * 4, whole, whole, not_utf8, untagged, st.binary(max_size=64))


def _fields(
    tag: str, always: dict[str, st.SearchStrategy[Any]], maybe: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    extra = st.dictionaries(st.sampled_from(["extra", "t2"]), anything, max_size=1)
    return st.builds(
        lambda fixed, optional, more: {"t": tag, **more, **fixed, **optional},
        st.fixed_dictionaries(always),
        st.fixed_dictionaries({}, optional=maybe),
        st.one_of(st.just({}), st.just({}), st.just({}), st.just({}), extra),
    )


# --- the gateway -----------------------------------------------------------------------


def _send(address: str, body: bytes) -> ControlReply | None:
    """``body`` as one request on a fresh ``REQ`` socket; the reply, or ``None``."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{address}")
    try:
        socket.send(sealed(body, client_token(address)))
        if not socket.poll(int(DEADLINE * 1000)):
            return None
        reply: ControlReply = _replies.decode(socket.recv())
        return reply
    finally:
        socket.close()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, KernelInfo]]:
    """The gateway, and its protected kernel, whose cell set ``x = 40``."""
    process, address, log = control_gateway(tmp_path_factory.mktemp("gateway"), gpus_per_host=0)
    try:
        kernel = anyio.run(_protected_kernel, address)
        yield process, address, log, kernel
    finally:
        stop(process)


async def _protected_kernel(address: str) -> KernelInfo:
    await status_when(address, lambda s: sum(h.state == "up" for h in s.hosts) == 3)
    kernel = await ask(address, StartKernel())
    assert isinstance(kernel, KernelInfo), kernel
    assert await run_cell(kernel, "x = 40") == {"status": "ok", "stdout": ""}
    return kernel


def _replicas(reply: ControlReply | None) -> dict[str, Any]:
    assert isinstance(reply, KernelList), reply
    return {
        k.kernel_id: [(r.node, r.host, r.pid, r.alive) for r in k.replicas] for k in reply.kernels
    }


def test_any_request_is_answered_and_changes_no_other_kernel(
    gateway: tuple[subprocess.Popen[bytes], str, Path, KernelInfo],
) -> None:
    process, address, log, protected = gateway
    listing = msgspec.msgpack.encode(ListKernels())
    before = _replicas(_send(address, listing))
    assert before == {
        protected.kernel_id: [(r.node, r.host, r.pid, True) for r in protected.replicas]
    }

    # No shrinking: the gateway is one process for every example, and one that a request
    # ended cannot come back, so each later example fails alike (and fast: nothing is sent
    # to a gateway that exited); the first failing example is the one reported.
    @settings(sized(examples=150), phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(body=requests(protected.kernel_id))
    def one_request(body: bytes) -> None:
        reply = _send(address, body) if process.poll() is None else None
        assert reply is not None and process.poll() is None, (
            f"no reply to {body!r}, or the gateway exited:\n{log.read_text()[-3000:]}"
        )
        # A ControlError is a refusal (malformed, unknown) or a typed failure; an exception
        # that is no nbos error would be a bug, even if the gateway survives it.
        if isinstance(reply, ControlError):
            assert "unexpectedly" not in reply.message, (body, reply)
        assert _replicas(_send(address, listing)) == before, body

    one_request()
    assert anyio.run(run_cell, protected, "print(x + 2)") == {"status": "ok", "stdout": "42\n"}
