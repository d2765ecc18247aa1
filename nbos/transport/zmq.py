"""A :class:`~nbos.core.transport.Transport` over ZeroMQ (pyzmq).

Design
------
* Each endpoint binds one **ROUTER** socket, the only socket it reads. Every
  message arrives as ``[sender id, payload]``; anything else (a wrong frame
  count, a routing id that is not a peer id) is logged, counted in
  :attr:`ZmqTransport.rejected` and dropped, and the endpoint reads on.
* It sends through one **DEALER** per peer, connected to the peer's address, with
  the local peer id as routing identity. One pipe per peer gives each peer its
  own bounded queue (``SNDHWM = queue_size``): a slow or dead peer fills only its
  own queue, and a send that would exceed it fails at once (``NOBLOCK``) and is
  counted in :attr:`ZmqTransport.dropped`. ``IMMEDIATE`` stays off, so messages
  to a peer that is not connected yet (or restarting) wait in that queue, and
  ZeroMQ reconnects on its own. ZMTP heartbeats tear down half-open
  connections to a vanished host so that the reconnection starts.
* The ROUTER sets ``ROUTER_HANDOVER``: a restarted peer connects with the same
  routing id before the old connection is noticed dead, and must take it over
  rather than be ignored.
* Sockets are plain (blocking-API) pyzmq sockets used only with ``NOBLOCK``,
  and ``receive`` waits on the ROUTER's ``ZMQ_FD`` through one asyncio reader
  kept for the endpoint's lifetime (:class:`_Readiness`). Unlike a
  ``zmq.asyncio`` future, which can complete with a message and then be
  cancelled before its task resumes, a message here is taken off the socket
  only in synchronous code that returns it: cancelling ``receive`` never loses
  one. It also costs less per message than ``zmq.asyncio`` (see
  ``bench/transport.py``). It needs anyio's asyncio backend and must be used
  from the event loop that opened it. A ``receive`` that finds a message ready
  returns without a trip through the event loop, except every 32nd in a row,
  which yields so that a backlog cannot starve other tasks.
* ZeroMQ's I/O thread runs as ``SCHED_BATCH`` (Linux), so that waking it for a send
  does not preempt the sender on a busy machine (:func:`_batch_io_threads`).
* Payloads of :data:`ZERO_COPY_THRESHOLD` bytes or more (``bytes`` only, since
  they cannot change after the call) are sent without a copy.
* Without CURVE anyone who can reach the port can send; libzmq even parses
  legacy ZMTP/1.0 framing, so raw bytes may surface as a malformed message,
  which is dropped like any other.

CURVE
-----
With :class:`CurveKeys`, every endpoint has one key pair, used as the CURVE
server key of its ROUTER and the client key of its DEALERs. A ZAP handler
(:class:`zmq.auth.asyncio.AsyncioAuthenticator`) admits only clients whose public
key is in ``allowed_clients`` and logs every refusal. A DEALER must know the
server public key of the peer it connects to: ``add_peer(..., server_key=...)``;
by default it is the endpoint's own public key, which is the *cluster key*
model where all members share one key pair (a kernel's replicas do). Keys
authenticate cluster membership, not individual peer ids: an admitted member
can claim any routing id. The ZAP handler is pyzmq's, which runs as its own
asyncio task from :meth:`ZmqTransport.open` until :meth:`ZmqTransport.aclose`;
ZAP tells it the refused key but not the remote address, so the log names the key.
:func:`start_authenticator` (:func:`start_thread_authenticator` where no asyncio loop
runs), :func:`curve_server` and :func:`curve_client` are those steps, one socket at a time.

Where nbos uses it: agent links with the cluster's keys (:mod:`nbos.transport.keys`,
``allowed_clients`` and a ``server_key`` per host), and each kernel's Raft group
with a key pair of the kernel's own (the cluster key model, on a gateway with keys);
the same pair guards the replicas' Jupyter sockets (``nbos.kernel.replica``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, TypeVar, cast

import anyio
import anyio.lowlevel
import attrs
import zmq
import zmq.auth.asyncio
import zmq.auth.thread

from nbos.core.errors import TransportError, UnknownPeerError
from nbos.core.ids import PeerId
from nbos.transport._endpoint import Endpoint

log = logging.getLogger(__name__)
_Auth = TypeVar("_Auth", bound=zmq.auth.Authenticator)

#: Payloads at least this large are handed to ZeroMQ without a copy.
ZERO_COPY_THRESHOLD = 64 * 1024
#: Default largest payload an endpoint accepts; larger inbound messages close the connection.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 1000
#: A dead link is found by the operating system's TCP, not by ZeroMQ's own pings: those
#: woke every endpoint's I/O thread each second, about half of what an idle kernel's
#: replicas cost. Keepalive probes (an idle link) and the retransmission timeout (data
#: unacknowledged) are answered and timed in the kernel, and end a link to a host that
#: vanished within seconds all the same; ZeroMQ then reconnects.
_TCP_LIVENESS: dict[int, int] = {
    zmq.TCP_KEEPALIVE: 1,
    zmq.TCP_KEEPALIVE_IDLE: 2,
    zmq.TCP_KEEPALIVE_INTVL: 1,
    zmq.TCP_KEEPALIVE_CNT: 3,
    zmq.TCP_MAXRT: 3000,
}


@attrs.frozen
class CurveKeys:
    """CURVE keys of one endpoint (Z85-encoded, as from :func:`zmq.curve_keypair`).

    ``allowed_clients``: public keys admitted to this endpoint's ROUTER; empty
    means only ``public_key`` itself (the cluster key model).
    """

    secret_key: bytes
    public_key: bytes
    allowed_clients: frozenset[bytes] = frozenset()

    def __attrs_post_init__(self) -> None:
        for name, key in (("secret_key", self.secret_key), ("public_key", self.public_key)):
            _check_key(name, key)
        for key in self.allowed_clients:
            _check_key("allowed_clients", key)

    @property
    def admitted(self) -> frozenset[bytes]:
        """The client keys the ZAP handler admits."""
        return self.allowed_clients or frozenset({self.public_key})


def _check_key(name: str, key: bytes) -> None:
    if len(key) != 40:
        log.warning("bad CURVE key for %s: %d bytes", name, len(key))
        raise TransportError(f"{name} must be a 40-character Z85 CURVE key, got {len(key)} bytes")


class _KeyRing:
    """ZAP credentials provider: admits listed client keys, logs the rest."""

    def __init__(self, local: str, admitted: frozenset[bytes]) -> None:
        self._local = local
        self._admitted = set(admitted)

    def admit(self, key: bytes) -> None:
        self._admitted.add(key)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._admitted:
            return True
        log.warning("%s: refused CURVE client key %s (domain %r)", self._local, key, domain)
        return False


def start_authenticator(
    context: zmq.Context[Any], local: str, curve: CurveKeys
) -> zmq.auth.asyncio.AsyncioAuthenticator:
    """Start a ZAP handler on ``context`` (a task of the running asyncio loop) under which
    its CURVE servers admit only ``curve.admitted`` and log every other key; ``stop()`` it
    before the context ends. Start it before such a server binds."""
    return _start(zmq.auth.asyncio.AsyncioAuthenticator(context, log=log), local, curve)


def start_thread_authenticator(
    context: zmq.Context[Any], local: str, curve: CurveKeys
) -> zmq.auth.thread.ThreadAuthenticator:
    """:func:`start_authenticator` for a context without an asyncio loop: the ZAP handler
    runs on a thread of its own (a replica's Jupyter sockets, served by ipykernel)."""
    return _start(zmq.auth.thread.ThreadAuthenticator(context, log=log), local, curve)


def _start(auth: _Auth, local: str, curve: CurveKeys) -> _Auth:
    auth.start()
    auth.configure_curve_callback("*", _KeyRing(local, curve.admitted))
    return auth


def admit_client(auth: zmq.auth.Authenticator, key: bytes) -> None:
    """Have ``auth`` (of :func:`start_authenticator`) admit client ``key`` from now on."""
    _check_key("client key", key)
    keyring = auth.credentials_providers["*"]
    assert isinstance(keyring, _KeyRing)
    keyring.admit(key)


def _batch_io_threads(context: zmq.Context[Any]) -> None:
    """Have ``context``'s I/O thread run as ``SCHED_BATCH``: before its first socket.

    A send wakes the I/O thread; as an ordinary thread it then preempts the sender on a
    busy machine, which pays two context switches per message (a Raft follower spent
    half its busy time in ``send``). A batch thread gets the same share of the CPU but
    waits for a free core or for the sender to block. With 64 proposers on 2 cores this
    took Raft from 11,100-11,900 to 12,900-13,700 commits/s, and commit p50 down 4-8%
    (``bench/raft.py``). Only a thread of the ordinary policy changes: libzmq aborts
    where it may not change the policy, and a deployment that chose one keeps it.
    """
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is not None and os.sched_getscheduler(0) == os.SCHED_OTHER:
        context.set(zmq.THREAD_SCHED_POLICY, batch)


def curve_server(socket: zmq.Socket[Any], curve: CurveKeys) -> None:
    """Make ``socket`` (before it binds) a CURVE server with ``curve``'s key pair."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)


def curve_client(socket: zmq.Socket[Any], curve: CurveKeys, server_key: bytes | None) -> None:
    """Make ``socket`` (before it connects) a CURVE client with ``curve``'s key pair, of a
    server whose public key is ``server_key`` (``None``: ``curve``'s own, the cluster key)."""
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_key or curve.public_key)


class _Readiness:
    """Wakes receivers when the ROUTER has input, through one long-lived loop reader.

    ``ZMQ_FD`` is edge-like: it turns readable when ZeroMQ has news and is reset
    when ZeroMQ processes them (on a recv or a read of ``EVENTS``). The reader
    reads ``EVENTS`` on every wake-up, which both tells whether a message waits
    and resets the descriptor, so an unread message cannot spin the loop.
    Keeping the reader registered saves two ``epoll_ctl`` calls per wait.
    """

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise TransportError("ZmqTransport runs on an asyncio event loop only") from None
        self._socket = socket
        self._fd = int(socket.getsockopt(zmq.FD))
        self._waiters: set[asyncio.Future[None]] = set()
        self._loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        if cast(int, self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self) -> None:
        """Return when a message may be waiting; cancelling this takes nothing."""
        waiter = self._loop.create_future()
        self._waiters.add(waiter)
        try:
            # The last failed recv reset the descriptor: news since then wake us.
            await waiter
        finally:
            self._waiters.discard(waiter)

    def close(self) -> None:
        """Stop watching; waiters wake up and see the transport closed."""
        self._loop.remove_reader(self._fd)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class ZmqTransport(Endpoint):
    """A ZeroMQ endpoint; create it with :meth:`open` (see the module docstring)."""

    def __init__(
        self,
        local: PeerId,
        *,
        bind: str,
        queue_size: int,
        curve: CurveKeys | None,
        max_message_size: int,
    ) -> None:
        super().__init__(local, queue_size=queue_size, max_message_size=max_message_size)
        self._identity = local.encode()
        self._curve = curve
        self._context: zmq.Context[Any] = zmq.Context()
        _batch_io_threads(self._context)
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._dealers: dict[PeerId, tuple[zmq.Socket[bytes], str, bytes | None]] = {}
        try:
            if curve is not None:
                self._start_auth(curve)
            self._router = self._bind(bind)
            self._readiness = _Readiness(self._router)
        except BaseException:
            self._teardown()
            raise
        self._address = bytes(self._router.getsockopt(zmq.LAST_ENDPOINT)).decode()

    @classmethod
    async def open(
        cls,
        local: PeerId | str,
        bind: str = "tcp://127.0.0.1:0",
        *,
        queue_size: int = 1000,
        curve: CurveKeys | None = None,
        max_message_size: int = MAX_MESSAGE_SIZE,
    ) -> ZmqTransport:
        """Bind an endpoint for ``local`` at ``bind`` (port 0 picks a free port).

        Raises :class:`TransportError` if the address cannot be bound.
        """
        await anyio.lowlevel.checkpoint()
        return cls(
            PeerId(local),
            bind=bind,
            queue_size=queue_size,
            curve=curve,
            max_message_size=max_message_size,
        )

    # --- peers -------------------------------------------------------------------

    def add_peer(self, peer: PeerId, address: str, *, server_key: bytes | None = None) -> None:
        """Learn where ``peer`` is; ``server_key`` is its CURVE public key (see module doc).

        Re-adding a peer at the same address and key keeps its queue; a new
        address or key replaces the connection and discards what was queued.
        """
        self._check_open()
        if server_key is not None:
            _check_key("server_key", server_key)
        current = self._dealers.get(peer)
        if current is not None and current[1:] == (address, server_key):
            return
        dealer = self._dealer(peer, address, server_key)
        self.remove_peer(peer)
        self._dealers[peer] = (dealer, address, server_key)

    def admit_client(self, key: bytes) -> None:
        """Admit CURVE client ``key`` too (a host that joined with a token); without CURVE
        nothing (every client is admitted)."""
        if self._auth is not None:
            admit_client(self._auth, key)

    def remove_peer(self, peer: PeerId) -> None:
        entry = self._dealers.pop(peer, None)
        if entry is not None:
            entry[0].close(linger=0)

    # --- data --------------------------------------------------------------------

    async def send(self, peer: PeerId, payload: bytes) -> None:
        self._check_open()
        entry = self._dealers.get(peer)
        if entry is None:
            raise UnknownPeerError(peer)
        self._check_size(peer, payload)
        try:
            # Zero-copy only for immutable bytes: a caller could change a bytearray later.
            zero_copy = len(payload) >= ZERO_COPY_THRESHOLD and type(payload) is bytes
            entry[0].send(payload, zmq.NOBLOCK, copy=not zero_copy)
        except zmq.Again:
            self._count_drop(peer)

    async def receive(self) -> tuple[PeerId, bytes]:
        message = self._receive_nowait()
        if message is not None:
            await self._took_a_waiting_message()
            return message
        self._waited()
        while True:
            await self._readiness.wait()
            message = self._receive_nowait()
            if message is not None:
                return message

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._readiness.close()
        self._teardown()

    # --- internals ---------------------------------------------------------------

    def _receive_nowait(self) -> tuple[PeerId, bytes] | None:
        """Take the next well-formed message off the ROUTER, or ``None``."""
        self._check_open()
        router = self._router
        # Asking EVENTS first is cheaper than the zmq.Again exception of an empty recv.
        while cast(int, router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if len(frames) == 2 and frames[0][:1] != b"\x00":
                try:
                    return PeerId(frames[0].decode()), frames[1]
                except UnicodeDecodeError:
                    pass
            self._rejected += 1
            log.warning(
                "%s: dropped a malformed message (%d frames, routing id %r)",
                self._local,
                len(frames),
                frames[0][:64],
            )
        return None

    def _start_auth(self, curve: CurveKeys) -> None:
        # The handler must be bound before the ROUTER accepts its first connection.
        self._auth = start_authenticator(self._context, self._local, curve)

    def _bind(self, address: str) -> zmq.Socket[bytes]:
        router: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self._queue_size)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        for option, value in _TCP_LIVENESS.items():
            router.setsockopt(option, value)
        if self._curve is not None:
            curve_server(router, self._curve)
        try:
            router.bind(address)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            log.warning("%s: cannot bind %r: %s", self._local, address, exc)
            raise TransportError(f"cannot bind {address!r}: {exc}") from exc
        return router

    def _dealer(self, peer: PeerId, address: str, server_key: bytes | None) -> zmq.Socket[bytes]:
        dealer: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        options: dict[int, int | bytes] = {
            zmq.LINGER: 0,
            zmq.SNDHWM: self._queue_size,
            # Nothing is ever read from a DEALER; keep what a rogue peer could push small.
            zmq.RCVHWM: 1,
            zmq.ROUTING_ID: self._identity,
            zmq.RECONNECT_IVL: _RECONNECT_IVL_MS,
            zmq.RECONNECT_IVL_MAX: _RECONNECT_IVL_MAX_MS,
            **_TCP_LIVENESS,
        }
        for option, value in options.items():
            dealer.setsockopt(option, value)
        if self._curve is not None:
            curve_client(dealer, self._curve, server_key)
        try:
            dealer.connect(address)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            log.warning("%s: bad address %r for peer %r: %s", self._local, address, peer, exc)
            raise TransportError(f"cannot connect to {address!r}: {exc}") from exc
        return dealer

    def _teardown(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._dealers.clear()
        self._context.destroy(linger=0)
