"""The front's requests to replicas, and what replicas send back, relayed to clients.

A request relayed to one replica is pending until its reply and its ``idle`` came
back, or the replica died. Only the replica a request went to is heard on IOPub, and
only for that request (or, late, for a request it finished: a thread the cell
started); replicas' own ``status`` messages are dropped. stdin is relayed between the
client and the replica handling the shell request in flight.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import zmq.asyncio

from nbos.core.errors import AuthenticationError, DecodeError, KernelError, NbosError
from nbos.kernel import protocol
from nbos.kernel.front import _requests, _wire
from nbos.kernel.front._clients import ClientChannels, Incoming
from nbos.kernel.front._liveness import Liveness
from nbos.kernel.front._shell_idle import ShellIdle
from nbos.kernel.front._upstream import Channel, Upstream

log = logging.getLogger(__name__)

#: After a replica's reply, how long to wait for its ``idle`` before going on without it.
#: A live replica always sends one, after all the request's output: a loaded machine can
#: hold it back for seconds, and an idle sent before that output would cut it off the
#: cell. A replica that dies ends the wait at once; this bounds only a lost message.
IDLE_GRACE_S = 30.0
#: After a replica's ``idle``, how long to wait for a reply it has not sent (ipykernel
#: sends none for a request its handler failed on) before the client gets an error.
NO_REPLY_GRACE_S = 10.0
_FINISHED_KEPT = 256
#: How the topic of a replica's status messages ends (ipykernel's ``kernel.<id>.status``).
_STATUS_TOPIC = b".status"


@attrs.define(eq=False)
class Pending:
    """A request relayed to one replica, until its reply and its ``idle`` came back.

    ``replied`` is set by the reply (or, for a message without one, by the idle),
    ``idled`` by the replica's ``idle``, or by the reply once the IOPub messages it
    counts (``published``) were relayed; both by the replica's death (``lost``);
    ``heard`` by whichever of them comes first.
    """

    msg_id: str
    target: int
    idents: list[bytes]
    expects_reply: bool
    #: It is useless without a majority of replicas (a cell, a settle): it ends as lost
    #: once the front loses its majority.
    needs_quorum: bool = False
    reply: _wire.Msg | None = None
    lost: bool = False
    #: The reply went to the client as the request's final answer.
    answered: bool = False
    #: The request is on its way to the replica (its socket took it).
    sent: bool = False
    #: IOPub messages the reply says the replica published for the request before it.
    published: int | None = None
    #: The replica's IOPub messages for the request relayed so far.
    relayed: int = 0
    replied: anyio.Event = attrs.Factory(anyio.Event)
    idled: anyio.Event = attrs.Factory(anyio.Event)
    heard: anyio.Event = attrs.Factory(anyio.Event)

    def got_reply(self, reply: _wire.Msg) -> None:
        self.reply = reply
        self.published = protocol.take_published_count(reply["metadata"])
        self.replied.set()
        self.heard.set()
        self._idle_once_relayed()

    def got_output(self) -> None:
        self.relayed += 1
        self._idle_once_relayed()

    def _idle_once_relayed(self) -> None:
        # Counted messages are sent in order on one socket: relaying that many means
        # relaying those, so nothing of the request is still on its way.
        if self.published is not None and self.relayed >= self.published:
            self.idled.set()

    def got_idle(self) -> None:
        self.idled.set()
        if not self.expects_reply:
            self.replied.set()
        self.heard.set()

    def got_lost(self) -> None:
        self.lost = True
        self.replied.set()
        self.idled.set()
        self.heard.set()


class Relay:
    """Kernel ``kernel_id``'s requests in flight to the replicas of ``upstreams`` (the
    front's map, read here only), and the readers of those replicas' sockets.

    ``idle`` is told when everything of the shell request in flight is out;
    ``refusal()`` is the error of a request that no live replica is left to serve.
    """

    def __init__(
        self,
        kernel_id: str,
        upstreams: Mapping[int, Upstream],
        clients: ClientChannels,
        liveness: Liveness,
        idle: ShellIdle,
        *,
        refusal: Callable[[], NbosError],
    ) -> None:
        self._kernel_id = kernel_id
        self._upstreams = upstreams
        self._clients = clients
        self._liveness = liveness
        self._idle = idle
        self._refusal = refusal
        self._pending: dict[str, Pending] = {}
        #: Shell requests that finished, and the replica that handled each.
        self._finished: OrderedDict[str, int] = OrderedDict()
        #: The client's shell request in flight (the cell, during one).
        self.active: Pending | None = None

    @property
    def busy(self) -> bool:
        """Whether a request is in flight."""
        return bool(self._pending)

    def end_requests_of(self, replica: int, *, its_own: bool = True) -> None:
        """``replica`` died: its requests end as lost (unless not ``its_own``), and so do
        those that need a majority once there is none."""
        quorum = self._liveness.has_quorum
        for pending in list(self._pending.values()):
            if (its_own and pending.target == replica) or (pending.needs_quorum and not quorum):
                pending.got_lost()

    async def control_request(
        self,
        replica: int,
        msg_type: str,
        content: Mapping[str, Any],
        *,
        timeout: float,
        needs_quorum: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> _wire.Msg | None:
        """Send a control request of the front's own to ``replica``; its reply or ``None``.

        ``None`` too when the replica is gone (dead, or removed by a replacement), or,
        for a request that ``needs_quorum``, once no majority of replicas is alive.
        """
        up = self._upstreams.get(replica)
        if up is None:
            return None
        msg = up.signer.new_message(msg_type, dict(content))
        msg["metadata"] = {**msg["metadata"], **(metadata or {})}
        with anyio.move_on_after(timeout):
            pending = await self.roundtrip(
                replica, "control", msg, [], grace=0.0, needs_quorum=needs_quorum
            )
            return pending.reply
        return None

    async def relay(
        self,
        idents: list[bytes],
        msg: _wire.Msg,
        channel: _requests.Channel,
        sock: zmq.asyncio.Socket,
        first: int | None,
    ) -> None:
        """Relay a client's request to a live replica (``first`` first, if it lives: the
        last executor) and its reply back; an error reply at once if none is left (a
        client must not wait for a reply nobody will send)."""

        async def relay(reply: _wire.Msg) -> bool:
            await self._clients.send(sock, reply, idents)
            return True

        expects_reply = msg["header"]["msg_type"].endswith("_request")
        alive = self._liveness.alive
        preferred = [first] if first in alive else []
        for target in [*preferred, *alive]:
            assert target is not None
            pending = await self.roundtrip(
                target, channel, msg, idents, grace=IDLE_GRACE_S, on_reply=relay
            )
            if pending.reply is not None or not expects_reply:
                return  # a comm message may have reached the log; never send it twice
            if not pending.lost:
                self._clients.refuse()
                failure = KernelError(f"replica {target} sent no reply to {msg['msg_type']}")
                log.warning("kernel %s: %s", self._kernel_id, failure)
                await self._clients.reply_error(idents, msg, channel, failure)
                return
        refused = (
            self._refusal()
            if not self._liveness.alive
            else KernelError(f"no live replica answered {msg['msg_type']}")
        )
        log.warning("kernel %s: %s refused: %s", self._kernel_id, msg["msg_type"], refused)
        await self._clients.reply_error(idents, msg, channel, refused)

    async def roundtrip(
        self,
        target: int,
        channel: Channel,
        msg: _wire.Msg,
        idents: list[bytes],
        *,
        grace: float,
        on_reply: Callable[[_wire.Msg], Awaitable[bool]] | None = None,
        on_sent: Callable[[Pending], None] | None = None,
        needs_quorum: bool = False,
        client: bool = True,
    ) -> Pending:
        """Send ``msg`` to ``target`` (then ``on_sent``); wait for its reply (``on_reply``
        gets it at once and says whether it answered the client), then for its idle (at
        most ``grace`` seconds longer). A request that ``needs_quorum`` ends as lost once
        no majority is alive; a shell ``msg`` of a ``client`` is the request in flight
        meanwhile."""
        header = msg["header"]
        expects_reply = header["msg_type"].endswith("_request")
        pending = Pending(header["msg_id"], target, idents, expects_reply, needs_quorum)
        up = self._upstreams[target]
        if not up.alive or (needs_quorum and not self._liveness.has_quorum):
            pending.got_lost()
            return pending
        self._pending[pending.msg_id] = pending
        shell = channel == "shell" and client
        if shell:
            self.active = pending
        try:
            try:
                await up.send(channel, msg)
            except KernelError as exc:
                log.info("kernel %s: %s", self._kernel_id, exc)
                pending.got_lost()
                return pending
            pending.sent = True
            if on_sent is not None:
                on_sent(pending)
            if shell:
                await self._clients.flush_busy()
            await _wait_reply(pending)
            if pending.reply is not None and on_reply is not None:
                # The client may have it before the replica's last output: as with any
                # kernel, a client waits for idle to know a request is complete.
                pending.answered = await on_reply(pending.reply)
                await self._finish_if_out(pending)
            # Everything the replica published for the request is out once the output
            # its reply counts was relayed, or its idle came; past the grace we go on
            # without them (an IOPub message can be lost).
            with anyio.move_on_after(grace) as waited:
                await pending.idled.wait()
            if waited.cancelled_caught and grace >= IDLE_GRACE_S:
                log.warning(
                    "kernel %s: no idle from replica %d for %s %s within %.0f s; going on",
                    self._kernel_id,
                    target,
                    header["msg_type"],
                    pending.msg_id,
                    grace,
                )
        finally:
            self._pending.pop(pending.msg_id, None)
            if self.active is pending:
                self.active = None
            if shell and not pending.lost:
                self._finished[pending.msg_id] = target
                if len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)
        return pending

    async def _finish_if_out(self, pending: Pending) -> None:
        """Publish the idle of the shell request in flight once everything of it is out:
        its reply went to the client and ``idled`` is set (in either order). The
        client need not wait for the request's task to unwind (releasing its plan)."""
        if pending.answered and pending.idled.is_set() and pending is self.active:
            await self._idle.flush()

    # --- what replicas send -----------------------------------------------------------

    async def read_replies(self, up: Upstream, channel: Channel) -> None:
        sock = up.sockets[channel]
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            if parsed is None:
                continue
            pending = self._pending.get(parsed[1]["parent_header"].get("msg_id", ""))
            if pending is not None and pending.target == up.replica and pending.reply is None:
                pending.got_reply(parsed[1])

    async def read_iopub(self, up: Upstream) -> None:
        while True:
            frames = await up.receive_iopub()
            if frames[0].endswith(_STATUS_TOPIC) and not self._awaits_idle(up.replica):
                # A status nobody waits for does nothing here: the replica's idle of a
                # request whose reply counted its output, mostly. Not even verified.
                continue
            parsed = self._parse_upstream(up, frames, content=False)
            if parsed is None:
                continue
            msg = parsed[1]
            parent_id = msg["parent_header"].get("msg_id", "")
            is_status = msg["header"]["msg_type"] == "status"
            pending = self._pending.get(parent_id)
            if pending is not None and pending.target == up.replica:
                if not is_status:
                    await self._clients.publish(msg)
                    pending.got_output()
                elif msg["content"].get("execution_state") == "idle":
                    pending.got_idle()
                await self._finish_if_out(pending)
            elif not is_status and self._finished.get(parent_id) == up.replica:
                # Late output of a finished request (a thread the cell started), from the
                # replica that ran it: a client shows it with that cell, as with ipykernel.
                await self._clients.publish(msg)
            # Neither receiving nor publishing waits while the replica's messages keep
            # coming: without a turn for the readers of this IOPub (the gateway's
            # WebSocket bridges, in this process), a flood would pile up in their queues.
            await anyio.lowlevel.checkpoint()

    def _awaits_idle(self, replica: int) -> bool:
        """Whether a request to ``replica`` waits for its idle."""
        return any(p.target == replica and not p.idled.is_set() for p in self._pending.values())

    async def read_input_requests(self, up: Upstream) -> None:
        sock = up.sockets["stdin"]
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse_upstream(up, frames)
            active = self.active
            if parsed is None or active is None or active.target != up.replica:
                continue
            await self._clients.send(self._clients.stdin, parsed[1], active.idents)

    async def read_client_stdin(self) -> None:
        while True:
            incoming = self._clients.parse(await self._clients.stdin.recv_multipart())
            active = self.active
            if incoming is None:
                continue
            if active is None or not self._upstreams[active.target].alive:
                log.warning("kernel %s: input_reply with no cell waiting", self._kernel_id)
                continue
            await self._upstreams[active.target].send("stdin", incoming[1])

    def _parse_upstream(
        self, up: Upstream, frames: list[bytes], *, content: bool = True
    ) -> Incoming | None:
        try:
            return up.signer.parse(frames, content=content)
        except (AuthenticationError, DecodeError) as exc:
            log.warning(
                "kernel %s: replica %d sent a bad message: %s", self._kernel_id, up.replica, exc
            )
            return None


async def _wait_reply(pending: Pending) -> None:
    """Until ``pending`` has its reply, or its replica went idle without sending one
    (:data:`NO_REPLY_GRACE_S` ago)."""
    # No task per request for the rare idle-first case: every cell waits here.
    await pending.heard.wait()
    if not pending.replied.is_set():
        with anyio.move_on_after(NO_REPLY_GRACE_S):
            await pending.replied.wait()
