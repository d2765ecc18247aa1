"""One client's channels on a kernel: the kernel front's ZeroMQ sockets, as a Jupyter client.

A :class:`ChannelBridge` connects shell, control and stdin ``DEALER`` sockets (one
identity, so the front's ``input_request`` for a cell of this client reaches its
stdin) and an IOPub ``SUB`` to the front, signs what the client sends with the
front's key and checks the signature of what comes back (``jupyter_client``'s
:class:`~jupyter_client.session.Session` does both). Every client has its own
bridge: replies go to the client that asked, IOPub to every client.

While no client is attached (its WebSocket closed mid-cell) the bridge keeps
reading and holds what arrives for the client that comes back with the same session id:
every message that is not output (statuses, replies, errors, comms), and of the output
(below) only the newest, within the bytes of its backlog's bound, oldest dropped first;
the client that comes back is told on stderr, in each cell whose output went, how much.
The shell reply of a cell can be read before the last of the cell's output (IOPub is
another socket, and may lag), so the bound must never drop what is not output. Past
:data:`BUFFER_MAX` messages held, output goes first, then the oldest of the rest. The
client that comes back gets what was held in the order it arrived, then what arrives
live. When the kernel is restarted the bridge connects to the new front; the client's
WebSocket stays open.

The bridge reads IOPub as fast as the front publishes, whatever the client does, so that
a slow client never backs ZeroMQ's queues up. Its sink counts the bytes given to it and
not yet written to the client's socket (its backlog); while that is over its bound
(``[gateway] client_backlog_mib``), the bridge drops the client's *output* (``stream``,
``display_data``, ``update_display_data``, ``execute_result``) and tells it so once per
cell on its stderr, as Jupyter Server does past its IOPub data rate. Statuses, replies
and every other message still go. So a client that reads slowly or not at all holds at
most that much of the gateway's memory, plus one message and the messages that are not
output; its kernel's other clients, its other channels and other kernels never wait for it.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol, cast

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import msgspec
import zmq
import zmq.asyncio
from jupyter_client.session import DELIM, Session

from nbos.gateway.http._wsproto import WireMsg
from nbos.kernel.jupyter_requests import channel_url, session_for

log = logging.getLogger(__name__)

#: Messages kept for a client that is away (its output within its backlog's bytes); output
#: goes first past it, then the oldest of the rest.
BUFFER_MAX = 10_000
#: IOPub messages that are output, which a client over its backlog goes without.
DROPPABLE = frozenset({"stream", "display_data", "update_display_data", "execute_result"})
#: How long to wait, in all, for the IOPub subscription to carry a first message.
_NUDGE_TIMEOUT_S = 10.0
_NUDGE_EVERY_S = 0.2

_SOCKETS = {"shell": zmq.DEALER, "control": zmq.DEALER, "stdin": zmq.DEALER, "iopub": zmq.SUB}

#: A message held for a client that is away: its place in the order of arrival, itself
#: and its header.
_Held = tuple[int, WireMsg, Mapping[str, Any]]


class Sink(Protocol):
    """Where a bridge delivers a client's messages (its WebSocket)."""

    def deliver(self, msg: WireMsg, header: Mapping[str, Any]) -> bool:
        """Send ``msg`` on; ``False`` once the client is gone."""
        ...

    def close(self) -> None:
        """End the client's connection (its kernel is gone, or a newer connection of its
        session replaced it)."""
        ...

    @property
    def backlog(self) -> int:
        """Bytes delivered and not yet sent on to the client."""
        ...


class KernelLink(Protocol):
    """The kernel a bridge follows across restarts."""

    @property
    def kernel_id(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def connection_info(self) -> Mapping[str, Any]: ...

    async def wait_changed(self, generation: int) -> None:
        """Return once the kernel was restarted past ``generation``, or ended."""
        ...


class ChannelBridge:
    """One client's shell, control, stdin and IOPub on a kernel; run it with :meth:`run`."""

    def __init__(
        self, link: KernelLink, session_key: str, ctx: zmq.asyncio.Context, backlog_bytes: int
    ) -> None:
        self.link = link
        #: Bytes the sink may hold unwritten before the client's output is dropped.
        self.backlog_bytes = backlog_bytes
        #: The client's session id (``?session_id=``); empty if it gave none.
        self.session_key = session_key
        self._ctx = ctx
        self._identity = f"{session_key or 'client'}-{secrets.token_hex(4)}".encode()
        self._sink: Sink | None = None
        #: Held output, and every other held message, each oldest first.
        self._held_output: deque[_Held] = deque()
        self._held_other: deque[_Held] = deque()
        #: Bytes of the messages in ``_held_output``.
        self._held_output_bytes = 0
        #: Messages held so far, the place of the next one.
        self._held_count = 0
        #: Whether held messages were dropped since a client was last attached (logged once).
        self._dropping_held = False
        #: Output dropped while nobody was attached, by cell (its packed parent header),
        #: which the next client is told of: cells in the order their output went.
        self._dropped_away: dict[bytes, _Dropped] = {}
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._session: Session | None = None
        self._nudges: set[str] = set()
        #: The packed parent header of the cell whose output this client goes without.
        self._dropping: bytes | None = None
        self._subscribed = anyio.Event()
        #: Set while connected to a front whose IOPub this bridge hears; what a client
        #: sends meanwhile waits for it.
        self._connected = anyio.Event()
        #: The kernel generation whose front the sockets are connected to.
        self._serving = -1
        self._closed = False
        self._scope = anyio.CancelScope()

    @property
    def attached(self) -> bool:
        return self._sink is not None

    def attach(self, sink: Sink) -> None:
        """Deliver to ``sink`` from now on, first what was held while nobody was attached,
        in the order it arrived.

        A ``sink`` that is closed already takes nothing: what it did not take stays held
        for the next client of the session.
        """
        self._dropping = None  # a new client is told afresh when its output is dropped
        self._dropping_held = False
        while self._held_output or self._held_other:
            held = self._oldest_held()
            place, msg, header = held[0]
            # A cell's notice goes where its dropped output was: before what came after
            # it (the cell's idle status among them, after which clients stop listening).
            if not self._tell_dropped(sink, before=place):
                return
            if not sink.deliver(msg, header):
                self._sink = None
                return
            held.popleft()
            if held is self._held_output:
                self._held_output_bytes -= _size(msg)
        if self._tell_dropped(sink, before=None):
            self._sink = sink

    def _tell_dropped(self, sink: Sink, before: int | None) -> bool:
        """Tell ``sink`` of each cell's output dropped while nobody was attached, the
        cells whose last dropped message came before held message ``before`` (``None``:
        all); ``False`` when it is closed (the next client of the session is told)."""
        while self._dropped_away:
            parent, dropped = next(iter(self._dropped_away.items()))
            if before is not None and dropped.last > before:
                return True
            text = (
                f"[nbos gateway] output dropped while this client was away: the oldest "
                f"{dropped.messages} messages ({dropped.size / 2**20:.1f} MiB) of this "
                f"cell's, past the {self.backlog_bytes // 2**20} MiB kept\n"
            )
            notice = _stderr_notice(parent, text)
            if not sink.deliver(notice, msgspec.json.decode(notice.parts[0])):
                self._sink = None
                return False
            del self._dropped_away[parent]
        return True

    def detach(self) -> None:
        """The client went away: hold its messages until it comes back (or :meth:`close`)."""
        self._sink = None

    def close(self) -> None:
        self._sink = None
        self._held_output.clear()
        self._held_other.clear()
        self._held_output_bytes = 0
        self._dropped_away.clear()
        self._scope.cancel()
        self._closed = True
        self._connected.set()  # nothing to wait for any more

    async def send(self, msg: WireMsg) -> None:
        """Sign ``msg`` and send it to the kernel on its channel.

        Between two kernels of a restart, it waits for the new one: from the restart on
        (not only once this bridge noticed it), and until the new front's IOPub is heard,
        so that no reply or output to the message is missed.
        """
        while not self._closed:
            await self._connected.wait()
            if self._serving == self.link.generation:
                break
            # The old front's sockets, not yet torn down by run(): wait for the new ones.
            await anyio.lowlevel.checkpoint()
        sock, session = self._sockets.get(msg.channel), self._session
        if sock is None or session is None:
            log.warning(
                "kernel %s: %s message with the kernel away", self.link.kernel_id, msg.channel
            )
            return
        await sock.send_multipart([DELIM, session.sign(list(msg.parts)), *msg.parts, *msg.buffers])

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Follow the kernel until :meth:`close` or its end; started once IOPub is subscribed."""
        with self._scope:
            try:
                while True:
                    generation = self.link.generation
                    async with anyio.create_task_group() as tg:
                        await tg.start(self._serve, self.link.connection_info, generation)
                        task_status.started()
                        task_status = anyio.TASK_STATUS_IGNORED
                        await self.link.wait_changed(generation)
                        tg.cancel_scope.cancel()
                    if self.link.generation == generation:
                        return  # the kernel ended
            except zmq.ZMQError:
                # One client's channels failing must not take the gateway's API down.
                log.exception(
                    "kernel %s: channels of session %s", self.link.kernel_id, self.session_key
                )
            finally:
                self._sink = None

    async def _serve(
        self, info: Mapping[str, Any], generation: int, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        sockets = {channel: self._ctx.socket(kind) for channel, kind in _SOCKETS.items()}
        try:
            for channel, sock in sockets.items():
                sock.setsockopt(zmq.LINGER, 0)
                if channel == "iopub":
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                else:
                    sock.setsockopt(zmq.IDENTITY, self._identity)
                sock.connect(channel_url(info, channel))
            self._session, self._sockets = session_for(info), sockets
            self._subscribed, self._nudges = anyio.Event(), set()
            async with anyio.create_task_group() as tg:
                for channel, sock in sockets.items():
                    tg.start_soon(self._read, channel, sock)
                await self._nudge()
                self._serving = generation
                self._connected.set()
                task_status.started()
        finally:
            # Readers are cancelled by now: closing a socket under a pending receive
            # would end that receive in a bare CancelledError.
            if self._sockets is sockets:
                self._sockets = {}
                if not self._closed:
                    self._connected = anyio.Event()
            for sock in sockets.values():
                sock.close(0)

    async def _nudge(self) -> None:
        """Wait until IOPub carries messages (a SUB misses what is sent before it joined).

        ``kernel_info_request`` on control makes the front publish a status at once,
        even while a cell runs; the replies to these requests go to nobody.
        """
        session = self._session
        assert session is not None
        with anyio.move_on_after(_NUDGE_TIMEOUT_S) as scope:
            while not self._subscribed.is_set():
                request = session.msg("kernel_info_request")
                self._nudges.add(request["header"]["msg_id"])
                await self._sockets["control"].send_multipart(session.serialize(request))
                with anyio.move_on_after(_NUDGE_EVERY_S):
                    await self._subscribed.wait()
        if scope.cancelled_caught:
            log.warning(
                "kernel %s: IOPub silent after %.0fs", self.link.kernel_id, _NUDGE_TIMEOUT_S
            )

    async def _read(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            parsed = self._parse(channel, frames)
            if channel == "iopub":
                self._subscribed.set()
            if parsed is not None:
                self._deliver(*parsed)

    def _parse(self, channel: str, frames: list[bytes]) -> tuple[WireMsg, Mapping[str, Any]] | None:
        session = self._session
        try:
            assert session is not None
            _, fed = session.feed_identities(frames)
            msg = session.deserialize(fed, content=False)
            parts = cast(list[bytes], fed)  # copied frames (feed_identities' default)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning(
                "kernel %s: bad message on %s from the front: %s", self.link.kernel_id, channel, exc
            )
            return None
        if msg["parent_header"].get("msg_id") in self._nudges:
            return None
        return WireMsg(channel, (parts[1], parts[2], parts[3], parts[4]), tuple(parts[5:])), msg[
            "header"
        ]

    def _deliver(self, msg: WireMsg, header: Mapping[str, Any]) -> None:
        sink = self._sink
        if sink is not None and self._over_backlog(sink, msg, header):
            return
        if sink is not None and sink.deliver(msg, header):
            return
        self._sink = None
        self._hold(msg, header)

    def _hold(self, msg: WireMsg, header: Mapping[str, Any]) -> None:
        """Keep ``msg`` for the client that comes back; drop the oldest output past the
        bound (and, past :data:`BUFFER_MAX` messages, the oldest message)."""
        held = (self._held_count, msg, header)
        self._held_count += 1
        if _is_output(msg, header):
            self._held_output.append(held)
            self._held_output_bytes += _size(msg)
        else:
            self._held_other.append(held)
        over_bytes = self._held_output_bytes > self.backlog_bytes
        over_count = len(self._held_output) + len(self._held_other) > BUFFER_MAX
        if (over_bytes or over_count) and not self._dropping_held:
            self._dropping_held = True
            log.warning(
                "kernel %s: %d messages (%d MiB of output) held for session %s: "
                "dropping the oldest output",
                self.link.kernel_id,
                len(self._held_output) + len(self._held_other),
                self._held_output_bytes // 2**20,
                self.session_key,
            )
        # The newest output stays, even alone over the bound.
        while len(self._held_output) > 1 and self._held_output_bytes > self.backlog_bytes:
            self._drop_held_output()
        while len(self._held_output) + len(self._held_other) > BUFFER_MAX:
            if self._held_output:
                self._drop_held_output()
            else:
                self._held_other.popleft()

    def _drop_held_output(self) -> None:
        """Drop the oldest held output, and count it for the client that comes back."""
        place, msg, _ = self._held_output.popleft()
        size = _size(msg)
        self._held_output_bytes -= size
        parent = msg.parts[1]
        dropped = self._dropped_away.get(parent, _Dropped())
        self._dropped_away[parent] = _Dropped(dropped.messages + 1, dropped.size + size, place)

    def _oldest_held(self) -> deque[_Held]:
        """The held queue whose first message arrived first (one is not empty)."""
        output, other = self._held_output, self._held_other
        if not other or (output and output[0][0] < other[0][0]):
            return output
        return other

    def _over_backlog(self, sink: Sink, msg: WireMsg, header: Mapping[str, Any]) -> bool:
        """Drop ``msg`` if it is output and ``sink`` is over its backlog; ``True`` if so."""
        if not _is_output(msg, header) or sink.backlog <= self.backlog_bytes:
            return False
        parent = msg.parts[1]
        if parent != self._dropping:
            self._dropping = parent
            log.warning(
                "kernel %s: session %s reads slower than the kernel writes: "
                "its output is dropped past %d MiB held",
                self.link.kernel_id,
                self.session_key or "-",
                self.backlog_bytes // 2**20,
            )
            text = (
                f"[nbos gateway] output dropped: this client reads slower than the kernel "
                f"writes ({self.backlog_bytes // 2**20} MiB not yet sent to it)\n"
            )
            notice = _stderr_notice(parent, text)
            sink.deliver(notice, msgspec.json.decode(notice.parts[0]))
        return True


def _is_output(msg: WireMsg, header: Mapping[str, Any]) -> bool:
    return msg.channel == "iopub" and header.get("msg_type") in DROPPABLE


def _size(msg: WireMsg) -> int:
    return sum(map(len, msg.parts)) + sum(map(len, msg.buffers))


@attrs.frozen
class _Dropped:
    """A cell's output dropped for a client that is away: how many messages and bytes, and
    the place (arrival number) of the last of them among the held messages."""

    messages: int = 0
    size: int = 0
    last: int = -1


def _stderr_notice(parent: bytes, text: str) -> WireMsg:
    """A stderr line ``text`` to a client whose output is dropped, in the cell ``parent``."""
    header = {
        "msg_id": secrets.token_hex(16),
        "msg_type": "stream",
        "username": "nbos",
        "session": "nbos-gateway",
        "date": datetime.now(UTC).isoformat(),
        "version": "5.3",
    }
    content = {"name": "stderr", "text": text}
    return WireMsg(
        "iopub", (msgspec.json.encode(header), parent, b"{}", msgspec.json.encode(content))
    )
