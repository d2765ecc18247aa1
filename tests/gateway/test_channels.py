"""A client's channels across a kernel restart, against fronts made of real ZeroMQ sockets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from nbos.gateway.http._channels import ChannelBridge
from nbos.gateway.http._wsproto import WireMsg

pytestmark = pytest.mark.anyio

KEY = "fake-front-key"
DEADLINE = 30.0


class Front:
    """A kernel front as a client sees it: every request on shell or control gets a busy
    status, its reply and an idle status, published at once (as a fresh kernel does).

    ``output``: lines of stdout each request gets after its reply and before its idle,
    once ``output_go`` is set (as a client reads a flood whose IOPub lags behind the
    shell reply)."""

    def __init__(self, ctx: zmq.asyncio.Context, output: list[str] | None = None) -> None:
        self.output = output or []
        self.output_go = anyio.Event()
        self.session = Session(key=KEY.encode(), username="front")
        self.routers = {c: ctx.socket(zmq.ROUTER) for c in ("shell", "control", "stdin")}
        self.iopub = ctx.socket(zmq.PUB)
        self.info: dict[str, Any] = {"transport": "tcp", "ip": "127.0.0.1", "key": KEY}
        for channel, sock in [*self.routers.items(), ("iopub", self.iopub)]:
            sock.setsockopt(zmq.LINGER, 0)
            self.info[f"{channel}_port"] = sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests: list[str] = []

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            for sock in self.routers.values():
                tg.start_soon(self._answer, sock)

    async def _answer(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            idents, frames = self.session.feed_identities(await sock.recv_multipart())
            request = self.session.deserialize(frames)
            self.requests.append(request["header"]["msg_type"])
            reply_type = request["header"]["msg_type"].replace("_request", "_reply")
            self.session.send(self.iopub, "status", {"execution_state": "busy"}, parent=request)
            self.session.send(sock, reply_type, {"status": "ok"}, parent=request, ident=idents)
            if self.output:
                await self.output_go.wait()
            for line in self.output:
                self.session.send(
                    self.iopub, "stream", {"name": "stdout", "text": line}, parent=request
                )
            self.session.send(self.iopub, "status", {"execution_state": "idle"}, parent=request)

    def close(self) -> None:
        for sock in [*self.routers.values(), self.iopub]:
            sock.close(0)


class Link:
    """The kernel a bridge follows: its front, replaced by a restart."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.generation = 0
        self._changed = anyio.Event()

    @property
    def kernel_id(self) -> str:
        return "k"

    @property
    def connection_info(self) -> Mapping[str, Any]:
        return self.front.info

    async def wait_changed(self, generation: int) -> None:
        while self.generation == generation:
            await self._changed.wait()

    def restart(self, front: Front) -> None:
        self.front, self.generation = front, self.generation + 1
        self._changed.set()
        self._changed = anyio.Event()


class Client:
    """A WebSocket as the bridge sees it: what was delivered, in order."""

    def __init__(self) -> None:
        self.seen: list[Mapping[str, Any]] = []
        self.arrived = anyio.Event()
        self.backlog = 0  # delivered at once

    def deliver(self, msg: WireMsg, header: Mapping[str, Any]) -> bool:
        parent = json.loads(msg.parts[1])
        content = json.loads(msg.parts[3])
        self.seen.append(
            {
                "type": header["msg_type"],
                "id": header["msg_id"],
                "parent": parent.get("msg_id"),
                **content,
            }
        )
        self.arrived.set()
        self.arrived = anyio.Event()
        return True

    def close(self) -> None:
        pass


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def execute_request(msg_id: str) -> WireMsg:
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request",
        "session": "s",
        "username": "u",
        "date": "2026-01-01T00:00:00Z",
        "version": "5.3",
    }
    parts = [json.dumps(p).encode() for p in (header, {}, {}, {"code": "1"})]
    return WireMsg("shell", (parts[0], parts[1], parts[2], parts[3]))


async def test_a_request_sent_as_the_kernel_restarts_reaches_the_new_front_with_its_output(
    ctx: zmq.asyncio.Context,
) -> None:
    old, new = Front(ctx), Front(ctx)
    link, client = Link(old), Client()
    bridge = ChannelBridge(link, "session", ctx, 2**20)
    async with anyio.create_task_group() as tg:
        tg.start_soon(old.serve)
        tg.start_soon(new.serve)
        await tg.start(bridge.run)
        bridge.attach(client)
        old.close()  # the old kernel is shut down before the restart answers
        link.restart(new)
        # At once, as a client that got the restart's answer sends its next cell.
        await bridge.send(execute_request("after-restart"))

        def mine() -> list[str]:
            return sorted(m["type"] for m in client.seen if m["parent"] == "after-restart")

        # The reply (shell) and the idle status (IOPub) come on two sockets, in either
        # order, as from any kernel.
        with anyio.fail_after(DEADLINE):
            while len(mine()) < 3:
                await client.arrived.wait()
        assert mine() == ["execute_reply", "status", "status"]
        assert "execute_request" in new.requests
        bridge.close()
        tg.cancel_scope.cancel()
    new.close()


def held_kinds(bridge: ChannelBridge) -> list[str]:
    """The types of the messages ``bridge`` holds that are not output."""
    return [header["msg_type"] for _, _, header in bridge._held_other]


def kib_lines(n: int) -> list[str]:
    """``n`` numbered lines of output, 1 KiB each."""
    return [f"{i:06d} {'x' * 1017}" for i in range(n)]


@asynccontextmanager
async def away_session(
    ctx: zmq.asyncio.Context, front: Front, bound: int
) -> AsyncIterator[ChannelBridge]:
    """A bridge to ``front`` holding for its session, whose client went before any cell;
    closed on the way out."""
    bridge = ChannelBridge(Link(front), "session", ctx, bound)
    async with anyio.create_task_group() as tg:
        tg.start_soon(front.serve)
        await tg.start(bridge.run)
        bridge.attach(Client())
        bridge.detach()
        yield bridge
        bridge.close()
        tg.cancel_scope.cancel()
    front.close()


async def test_a_session_back_gets_every_held_reply_and_status_and_the_newest_output(
    ctx: zmq.asyncio.Context,
) -> None:
    """The cell's output comes after its reply (IOPub lags behind shell) and is 4 times the
    bound: the bound drops the oldest output, never the reply or a status."""
    bound = 2**16
    lines = kib_lines(4 * bound // 1024)
    front, back = Front(ctx, output=lines), Client()
    async with away_session(ctx, front, bound) as bridge:  # all of the cell is held
        await bridge.send(execute_request("flood"))
        # The output comes once the reply is held, and the client once the cell's idle is
        # (IOPub's last): nothing tells that outside the bridge, so the test looks inside.
        with anyio.fail_after(DEADLINE):
            while not held_kinds(bridge).count("execute_reply"):  # noqa: ASYNC110
                await anyio.sleep(0.01)
            front.output_go.set()
            while held_kinds(bridge).count("status") < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        bridge.attach(back)
        front.output = []
        await bridge.send(execute_request("live"))
        with anyio.fail_after(DEADLINE):
            while len([m for m in back.seen if m["parent"] == "live"]) < 3:
                await back.arrived.wait()

    flood = [m for m in back.seen if m["parent"] == "flood"]
    # Every message that is not output, in the order they came (the reply on shell may
    # come before or after the busy).
    assert sorted(m["type"] for m in flood[:2]) == ["execute_reply", "status"], flood[:2]
    assert flood[-1].get("execution_state") == "idle", flood[-1]
    # Of the output only the newest, within the bound, in order, after one line on stderr
    # that says how much went.
    streams = [m for m in flood if m["type"] == "stream"]
    notice, printed = streams[0], [m["text"] for m in streams[1:]]
    assert 0 < len(printed) < len(lines)
    assert printed == lines[-len(printed) :]
    assert sum(map(len, printed)) <= bound
    assert notice["name"] == "stderr", notice
    assert f"the oldest {len(lines) - len(printed)} messages" in notice["text"], notice
    assert all(m["name"] == "stdout" for m in streams[1:])
    # Then live messages, and none twice.
    live = sorted(m["type"] for m in back.seen[len(flood) :])
    assert live == ["execute_reply", "status", "status"], live
    assert len({m["id"] for m in back.seen}) == len(back.seen)


def second_idle_held(bridge: ChannelBridge) -> bool:
    """Whether the idle status of the cell ``second`` is among what ``bridge`` holds."""
    return any(
        json.loads(msg.parts[1]).get("msg_id") == "second"
        and json.loads(msg.parts[3]).get("execution_state") == "idle"
        for _, msg, _ in bridge._held_other
    )


async def test_each_cell_whose_output_went_is_told_so_before_its_idle(
    ctx: zmq.asyncio.Context,
) -> None:
    """Two cells flood while the session is away, each twice the bound: the second's
    newest output is what is kept, so all of the first's goes. The client back is told of
    each cell's loss in that cell, before its idle (after which a client no longer listens
    to it): the first cell's notice among its own messages, not at the second's output."""
    bound = 2**16
    lines = kib_lines(2 * bound // 1024)
    front, back = Front(ctx, output=lines), Client()
    front.output_go.set()
    async with away_session(ctx, front, bound) as bridge:
        await bridge.send(execute_request("first"))
        await bridge.send(execute_request("second"))
        with anyio.fail_after(DEADLINE):
            while not second_idle_held(bridge):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        bridge.attach(back)

    first, second = (told(back, cell) for cell in ("first", "second"))
    # All of the first cell's output went, and its client hears so before its idle.
    assert first.kept == [] and f"the oldest {len(lines)} messages" in first.notice
    # The second keeps its newest output, after the notice of what went.
    assert 0 < len(second.kept) < len(lines) and second.kept == lines[-len(second.kept) :]
    assert f"the oldest {len(lines) - len(second.kept)} messages" in second.notice


@dataclass
class Told:
    """What a client saw of a cell: the notice of its dropped output and the output kept."""

    notice: str
    kept: list[str]


def told(client: Client, cell: str) -> Told:
    """The cell's one notice, which came before its output kept and its idle status."""
    seen = [m for m in client.seen if m["parent"] == cell]
    notices = [i for i, m in enumerate(seen) if m.get("name") == "stderr"]
    assert len(notices) == 1, seen[:4]
    later = [m for m in seen[notices[0] :] if m.get("execution_state") == "idle"]
    assert len(later) == 1, seen[-4:]
    kept = [m["text"] for m in seen if m.get("name") == "stdout"]
    assert kept == [m["text"] for m in seen[notices[0] :] if m.get("name") == "stdout"]
    return Told(seen[notices[0]]["text"], kept)
