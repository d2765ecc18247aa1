"""The replica's session: replies count the request's IOPub messages; a cell's reply
waits for the request's idle, the others go out at once."""

from __future__ import annotations

import datetime
import json
import math
import warnings
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session, json_packer, json_unpacker
from zmq.eventloop.zmqstream import ZMQStream

from nbos.kernel.protocol import IOPUB_COUNT_KEY
from nbos.kernel.replica._session import ReplicaSession, pack_json, unpack_json

pytestmark = pytest.mark.anyio

KEY = b"replica-session-test"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Wire:
    """A shell stream and an IOPub socket of a replica, each with its reader."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.shell_reader = ctx.socket(zmq.PULL)
        port = self.shell_reader.bind_to_random_port("tcp://127.0.0.1")
        shell = zmq.Context.instance().socket(zmq.PUSH)
        shell.connect(f"tcp://127.0.0.1:{port}")
        self.shell = ZMQStream(shell)  # on this thread's loop, as the kernel's own
        self.iopub_reader = ctx.socket(zmq.PULL)
        port = self.iopub_reader.bind_to_random_port("tcp://127.0.0.1")
        self.iopub = zmq.Context.instance().socket(zmq.PUSH)
        self.iopub.connect(f"tcp://127.0.0.1:{port}")

    async def next_reply(self, timeout: float = 10) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            frames = await self.shell_reader.recv_multipart()
        _, parts = Session(key=KEY).feed_identities(frames)
        msg: dict[str, Any] = Session(key=KEY).deserialize(parts)
        return msg

    async def nothing_on_shell(self, wait: float = 0.3) -> bool:
        return await self.shell_reader.poll(int(wait * 1000)) == 0

    def close(self) -> None:
        self.shell.close(linger=0)
        self.iopub.close(linger=0)
        self.shell_reader.close(linger=0)
        self.iopub_reader.close(linger=0)


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    ctx = zmq.asyncio.Context()
    w = Wire(ctx)
    yield w
    w.close()
    ctx.term()


def request(session: Session, msg_type: str) -> dict[str, Any]:
    msg: dict[str, Any] = session.msg(msg_type, {})
    return msg


async def test_a_cells_reply_waits_for_its_idle_and_counts_what_was_published(
    wire: Wire,
) -> None:
    session = ReplicaSession(key=KEY)
    cell, other = request(session, "execute_request"), request(session, "execute_request")
    session.send(wire.iopub, "execute_input", {"code": "", "execution_count": 1}, parent=cell)
    session.send(wire.iopub, "stream", {"name": "stdout", "text": "a"}, parent=cell)
    session.send(wire.iopub, "stream", {"name": "stdout", "text": "b"}, parent=other)
    session.send(wire.iopub, "status", {"execution_state": "idle"}, parent=cell)
    sent = session.send(wire.shell, "execute_reply", {"status": "ok"}, parent=cell)
    assert sent is not None and sent["content"] == {"status": "ok"}
    assert await wire.nothing_on_shell()
    # output flushed after the reply was made, before the idle, counts too
    session.send(wire.iopub, "stream", {"name": "stderr", "text": "late"}, parent=cell)
    session.release(cell["header"]["msg_id"])
    reply = await wire.next_reply()
    assert reply["parent_header"]["msg_id"] == cell["header"]["msg_id"]
    assert reply["metadata"][IOPUB_COUNT_KEY] == 3
    session.release(cell["header"]["msg_id"])  # released once only
    assert await wire.nothing_on_shell()


async def test_other_replies_go_out_at_once_with_their_count(wire: Wire) -> None:
    session = ReplicaSession(key=KEY)
    info, complete = request(session, "kernel_info_request"), request(session, "complete_request")
    session.send(wire.shell, "kernel_info_reply", {"status": "ok"}, parent=info)
    reply = await wire.next_reply()
    assert reply["msg_type"] == "kernel_info_reply"
    assert reply["metadata"][IOPUB_COUNT_KEY] == 0
    session.send(wire.iopub, "display_data", {"data": {}, "metadata": {}}, parent=complete)
    session.send(wire.shell, "complete_reply", {"status": "ok"}, parent=complete, metadata={"a": 1})
    reply = await wire.next_reply()
    assert reply["metadata"] == {"a": 1, IOPUB_COUNT_KEY: 1}


async def test_a_reply_on_a_plain_socket_is_not_held(wire: Wire) -> None:
    # Only a ZMQStream of the calling thread's loop is held back and flushed by the kernel.
    session = ReplicaSession(key=KEY)
    cell = request(session, "execute_request")
    assert wire.shell.socket is not None
    session.send(wire.shell.socket, "execute_reply", {"status": "ok"}, parent=cell)
    reply = await wire.next_reply()
    assert reply["metadata"][IOPUB_COUNT_KEY] == 0


@pytest.mark.parametrize(
    "obj",
    [
        {"date": datetime.datetime.now(datetime.UTC), "text": "héllo ✓", "n": [1, 2.5, None]},
        {"data": b"\x00\x01binary", "items": {3, 4}, "pair": (1, "a")},
        {1: "int key", 2.5: "float key", "big": 2**80, "flag": True},
        {(1, 2): "tuple key"},  # msgspec refuses it: jupyter_client's packer takes it
    ],
    ids=["header-like", "bytes-set-tuple", "odd-keys", "fallback"],
)
def test_pack_makes_the_json_jupyter_clients_packer_makes(obj: dict[Any, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jupyter_client's deprecation of the fallback
        assert json.loads(pack_json(obj)) == json.loads(json_packer(obj))


def test_pack_writes_non_finite_floats_as_null() -> None:
    assert json.loads(pack_json({"a": math.nan, "b": [math.inf]})) == {"a": None, "b": [None]}


@pytest.mark.parametrize(
    "data",
    [b'{"a": [1, "x", {"b": null}]}', b'{"a": NaN}', b'{"a": "\xff"}', '{"s": "str"}'],
    ids=["plain", "nan-literal", "invalid-utf8", "str"],
)
def test_unpack_reads_what_jupyter_clients_unpacker_reads(data: bytes | str) -> None:
    assert repr(unpack_json(data)) == repr(json_unpacker(data))


def test_a_configured_packer_replaces_the_default() -> None:
    assert ReplicaSession(key=KEY).pack is pack_json
    assert ReplicaSession(key=KEY, packer="json").pack is json_packer
    assert ReplicaSession(key=KEY, packer="json").unpack is json_unpacker
