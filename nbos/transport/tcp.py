"""A :class:`~nbos.core.transport.Transport` over plain TCP on the event loop.

Why it exists
-------------
A ZeroMQ message crosses libzmq's I/O thread on each end: two thread wake-ups per
hop, about six per Raft round trip. On a loaded machine those wake-ups are most of
a round trip (64-byte echo on loopback, 2 cores: 62 µs here against 167 µs through
:class:`~nbos.transport.ZmqTransport`). This transport reads and writes its sockets
from the event loop itself. It has no encryption or authentication, so it serves
where CURVE is not configured; :func:`nbos.transport.open_transport` makes that choice.

Design
------
* An endpoint listens on one address. A peer's messages come over a connection the
  peer opened; its first frame names it (``hello``). Sends to a peer go over one
  outbound connection per peer, opened by this side: the two directions of a pair of
  peers are two connections, as ZeroMQ's ROUTER and DEALER sockets were.
* Frames are a 4-byte big-endian length and the payload. A connection that sends a
  bad hello or a frame over ``max_message_size`` is logged, counted in
  :attr:`TcpTransport.rejected` and closed; the endpoint reads on.
* Back-pressure: each peer has a queue of ``queue_size`` messages in front of its
  connection, used while the connection is down or the socket's write buffer is
  full; a send that finds that queue full is dropped and counted. Received messages
  wait in one inbox; past ``queue_size`` of them the endpoint stops reading its
  connections, so a slow reader pushes back on senders through TCP.
* A lost connection is opened again every 100 ms, backing off to 1 s. Messages
  queued meanwhile go out once it is up; those in the lost socket's buffers are lost.
* A dead link is found by the operating system's TCP (keepalive probes and a
  retransmission limit), as in :mod:`nbos.transport.zmq`.
* ``receive`` takes a message off the inbox only in synchronous code that returns
  it, so cancelling it loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
from typing import Final

import anyio.lowlevel

from nbos.core.errors import TransportError, UnknownPeerError
from nbos.core.ids import PeerId
from nbos.transport._endpoint import Endpoint

log = logging.getLogger(__name__)

#: Default largest payload an endpoint accepts; a larger inbound frame closes the connection.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024
_HEADER: Final = struct.Struct("!I")
_HELLO: Final = b"nbos-tcp/1 "
_SCRATCH = 1 << 16
# A payload this large is written after its header rather than copied behind it.
_JOIN_BELOW = 1 << 14
_CONNECT_TIMEOUT_S = 3.0
_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 1.0
# Options a platform lacks (the keepalive timing, TCP_USER_TIMEOUT) are left out.
_SOCKET_OPTIONS: tuple[tuple[int, int, int], ...] = tuple(
    (level, getattr(socket, name), value)
    for level, name, value in (
        (socket.IPPROTO_TCP, "TCP_NODELAY", 1),
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 2),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", 3000),
    )
    if hasattr(socket, name)
)


def parse_address(address: str, *, bind: bool = False) -> tuple[str, int]:
    """``tcp://host:port`` as ``(host, port)``. IPv6 hosts are written in brackets.

    Only to bind: port 0 (any free port) and host ``*``, every IPv4 interface, as in
    ZeroMQ.
    """
    scheme, sep, rest = address.partition("://")
    host, colon, port_text = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port_text.isdigit():
        raise TransportError(f"not a tcp://host:port address: {address!r}")
    port = int(port_text)
    if not (0 if bind else 1) <= port <= 65535:
        raise TransportError(f"bad port in {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "*":
        if not bind:
            raise TransportError(f"cannot connect to a wildcard address: {address!r}")
        return "0.0.0.0", port
    return host, port


def _tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for level, option, value in _SOCKET_OPTIONS:
        # An option the running kernel refuses is skipped: the others still apply.
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _write(stream: asyncio.Transport, payload: bytes) -> None:
    if len(payload) < _JOIN_BELOW:
        stream.write(_frame(payload))  # one system call
    else:
        stream.write(_HEADER.pack(len(payload)))
        stream.write(payload)


class _Inbound(asyncio.BufferedProtocol):
    """Reads one peer's connection into its endpoint's inbox."""

    def __init__(self, owner: TcpTransport) -> None:
        self._owner = owner
        self._stream: asyncio.Transport | None = None
        self.peer: PeerId | None = None
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # A frame too large for the scratch buffer is read straight into its own.
        self._body: bytearray | None = None
        self._filled = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._stream = transport
        _tune(transport)
        self._owner._accepted(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._forget(self)

    def pause(self) -> None:
        if self._stream is not None and self._stream.is_reading():
            self._stream.pause_reading()

    def resume(self) -> None:
        if self._stream is not None and not self._stream.is_reading():
            self._stream.resume_reading()

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif _SCRATCH - self._end < _HEADER.size or self._end == _SCRATCH:
            kept = self._end - self._start
            self._scratch[:kept] = self._scratch[self._start : self._end]
            self._start, self._end = 0, kept
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._filled += nbytes
            if self._filled == len(self._body):
                body, self._body = self._body, None
                self._on_frame(bytes(body))
            return
        self._end += nbytes
        self._parse()

    def _parse(self) -> None:
        while self._stream is not None and not self._stream.is_closing():
            available = self._end - self._start
            if available < _HEADER.size:
                return
            (size,) = _HEADER.unpack_from(self._scratch, self._start)
            if size > self._owner.max_message_size:
                self._reject(f"a {size}-byte frame")
                return
            begin = self._start + _HEADER.size
            if available - _HEADER.size >= size:
                self._start = begin + size
                self._on_frame(bytes(self._view[begin : self._start]))
            elif size + _HEADER.size > _SCRATCH:
                self._body = bytearray(size)
                self._filled = self._end - begin
                self._body[: self._filled] = self._view[begin : self._end]
                self._start = self._end = 0
                return
            else:
                return

    def _on_frame(self, payload: bytes) -> None:
        if self.peer is not None:
            self._owner._deliver(self, self.peer, payload)
            return
        name = payload[len(_HELLO) :]
        if not payload.startswith(_HELLO) or not 0 < len(name) < 256 or name[:1] == b"\0":
            self._reject(f"a bad hello {payload[:64]!r}")
            return
        try:
            self.peer = PeerId(name.decode())
        except UnicodeDecodeError:
            self._reject(f"a bad hello {payload[:64]!r}")

    def _reject(self, what: str) -> None:
        self._owner._reject(self.peer, what)
        self.abort()


class _Outbound(asyncio.Protocol):
    """This side's connection to one peer: written to, never read."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _tune(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._link.writable = False

    def resume_writing(self) -> None:
        self._link.writable = True
        self._link.flush()

    def data_received(self, data: bytes) -> None:
        pass  # peers never write on a connection they accepted


class _Link:
    """The queue and the outbound connection to one peer, reopened when it drops."""

    def __init__(self, owner: TcpTransport, peer: PeerId, address: str) -> None:
        self.address = address
        self._owner = owner
        self._peer = peer
        self._host, self._port = parse_address(address)
        self._queue: collections.deque[bytes] = collections.deque()
        self._stream: asyncio.Transport | None = None
        self.writable = True
        self._task = asyncio.get_running_loop().create_task(self._keep_connected())

    def send(self, payload: bytes) -> bool:
        """Write or queue ``payload``; ``False`` when it was dropped."""
        stream = self._stream
        if stream is not None and self.writable and not self._queue:
            _write(stream, payload)
            return True
        if len(self._queue) >= self._owner.queue_size:
            return False
        self._queue.append(payload)
        return True

    def flush(self) -> None:
        stream = self._stream
        while stream is not None and self.writable and self._queue:
            _write(stream, self._queue.popleft())

    def close(self) -> None:
        self._task.cancel()
        if self._stream is not None:
            self._stream.abort()
            self._stream = None
        self._queue.clear()

    async def wait_closed(self) -> None:
        await asyncio.gather(self._task, return_exceptions=True)

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        delay = _RETRY_FIRST_S
        while True:
            try:
                # Not asyncio.wait_for: on 3.11 it can swallow the cancellation of close().
                async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                    stream, protocol = await loop.create_connection(
                        lambda: _Outbound(self), self._host, self._port
                    )
            except (OSError, TimeoutError) as exc:
                log.debug("%s: cannot reach %s: %s", self._owner.local, self._peer, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            delay = _RETRY_FIRST_S
            stream.write(_frame(_HELLO + self._owner.local.encode()))
            self._stream, self.writable = stream, True
            self.flush()
            await protocol.closed
            self._stream = None
            log.debug("%s: connection to %s lost", self._owner.local, self._peer)
            await asyncio.sleep(_RETRY_FIRST_S)


class TcpTransport(Endpoint):
    """A TCP endpoint on the event loop; create it with :meth:`open` (see the module doc)."""

    def __init__(self, local: PeerId, *, queue_size: int, max_message_size: int) -> None:
        super().__init__(local, queue_size=queue_size, max_message_size=max_message_size)
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise TransportError("TcpTransport runs on an asyncio event loop only") from None
        self._links: dict[PeerId, _Link] = {}
        self._connections: set[_Inbound] = set()
        self._paused: set[_Inbound] = set()
        self._inbox: collections.deque[tuple[PeerId, bytes]] = collections.deque()
        self._waiters: set[asyncio.Future[None]] = set()
        self._server: asyncio.Server | None = None

    @classmethod
    async def open(
        cls,
        local: PeerId | str,
        bind: str = "tcp://127.0.0.1:0",
        *,
        queue_size: int = 1000,
        max_message_size: int = MAX_MESSAGE_SIZE,
    ) -> TcpTransport:
        """Listen for ``local`` at ``bind`` (port 0 picks a free port).

        Raises :class:`TransportError` if the address cannot be bound.
        """
        await anyio.lowlevel.checkpoint()
        transport = cls(PeerId(local), queue_size=queue_size, max_message_size=max_message_size)
        await transport._listen(bind)
        return transport

    def add_peer(self, peer: PeerId, address: str) -> None:
        """Learn where ``peer`` is. The same address again keeps its connection and
        queue; a new one replaces them."""
        self._check_open()
        current = self._links.get(peer)
        if current is not None and current.address == address:
            return
        parse_address(address)
        self.remove_peer(peer)
        self._links[peer] = _Link(self, peer, address)

    def remove_peer(self, peer: PeerId) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    async def send(self, peer: PeerId, payload: bytes) -> None:
        self._check_open()
        link = self._links.get(peer)
        if link is None:
            raise UnknownPeerError(peer)
        self._check_size(peer, payload)
        # A bytearray the caller changes later must not change what is queued.
        if not link.send(bytes(payload) if type(payload) is not bytes else payload):
            self._count_drop(peer)

    async def receive(self) -> tuple[PeerId, bytes]:
        self._check_open()
        if self._inbox:
            await self._took_a_waiting_message()
            return self._take()
        self._waited()
        while not self._inbox:
            waiter = self._loop.create_future()
            self._waiters.add(waiter)
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)
            self._check_open()
        return self._take()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        links = list(self._links.values())
        for link in links:
            link.close()
        self._links.clear()
        for connection in list(self._connections):
            connection.abort()
        self._wake()
        if self._server is not None:
            self._server.close()
        for link in links:
            await link.wait_closed()

    # --- internals ---------------------------------------------------------------

    async def _listen(self, bind: str) -> None:
        host, port = parse_address(bind, bind=True)
        try:
            self._server = await self._loop.create_server(
                lambda: _Inbound(self), host, port, reuse_address=True
            )
        except OSError as exc:
            log.warning("%s: cannot bind %r: %s", self._local, bind, exc)
            raise TransportError(f"cannot bind {bind!r}: {exc}") from exc
        name = self._server.sockets[0].getsockname()
        shown = f"[{name[0]}]" if ":" in name[0] else name[0]
        self._address = f"tcp://{shown}:{name[1]}"

    def _take(self) -> tuple[PeerId, bytes]:
        message = self._inbox.popleft()
        if self._paused and len(self._inbox) <= self.queue_size // 2:
            for connection in self._paused:
                connection.resume()
            self._paused.clear()
        return message

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _accepted(self, connection: _Inbound) -> None:
        if self._closed:
            connection.abort()
        else:
            self._connections.add(connection)

    def _forget(self, connection: _Inbound) -> None:
        self._connections.discard(connection)
        self._paused.discard(connection)

    def _deliver(self, connection: _Inbound, peer: PeerId, payload: bytes) -> None:
        self._inbox.append((peer, payload))
        if len(self._inbox) >= self.queue_size:
            connection.pause()
            self._paused.add(connection)
        self._wake()

    def _reject(self, peer: PeerId | None, what: str) -> None:
        self._rejected += 1
        log.warning("%s: closed a connection (peer %r) that sent %s", self._local, peer, what)
