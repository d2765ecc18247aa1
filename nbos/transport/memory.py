"""An in-memory network of :class:`~nbos.core.transport.Transport` endpoints.

For tests and the trace simulator. Everything the network decides (which message
is lost, duplicated, delayed, delivered next) comes from one ``random.Random``
seeded at construction, so a run is a function of the seed and of the order of
calls made on the network.

Two ways to move messages:

* **Automatic** (``manual=False``, the default): a ``send`` decides at once
  whether the message is lost or duplicated and how long each copy is delayed
  (uniform in ``delay``, real seconds); the copy becomes receivable at its due
  time. Random delays are what reorder messages in this mode.
* **Manual** (``manual=True``): sent messages wait in :attr:`MemoryNetwork.in_flight`
  until a test moves them with the synchronous pump API: :meth:`~MemoryNetwork.deliver_one`
  (seeded choice when ``reorder``, else oldest first, then seeded drop and
  duplicate), :meth:`~MemoryNetwork.deliver_all`, or the explicit
  :meth:`~MemoryNetwork.deliver` and :meth:`~MemoryNetwork.discard`. Delivered
  messages are read with ``await receive()`` or the synchronous
  :meth:`MemoryTransport.receive_nowait`, so a sans-IO Raft core can be driven
  step by step without an event loop.

Links are cut with :meth:`~MemoryNetwork.partition`, :meth:`~MemoryNetwork.cut`
(one way) and restored with :meth:`~MemoryNetwork.heal`; a message is lost if its
link is cut when it is sent or when it is delivered. Every decision is appended
to :attr:`MemoryNetwork.trace`.

Back-pressure: messages from one sender to one receiver that are in flight or
waiting in the receiver's inbox count against ``queue_size``; a send beyond it
is dropped and counted in the sender's ``dropped``. A duplicate the network
makes is discarded, silently, when that queue is full.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import anyio
import anyio.lowlevel
import attrs

from nbos.core.errors import ConfigError, TransportClosedError, TransportError, UnknownPeerError
from nbos.core.ids import PeerId

log = logging.getLogger(__name__)

ADDRESS_SCHEME = "mem://"

TraceKind = Literal["send", "overflow", "cut", "drop", "duplicate", "deliver", "discard", "dead"]


@attrs.frozen
class Envelope:
    """One copy of a message on its way; ``seq`` is unique per copy within a network."""

    seq: int
    src: PeerId
    dst: PeerId
    payload: bytes


@attrs.frozen
class TraceEvent:
    """One decision of the network about one message copy."""

    kind: TraceKind
    seq: int
    src: PeerId
    dst: PeerId


def address_of(peer: PeerId | str) -> str:
    """The address an endpoint of ``peer`` listens on in a :class:`MemoryNetwork`."""
    return ADDRESS_SCHEME + peer


@attrs.define
class _Inbox:
    """Copies delivered or due for an endpoint, ordered by due time, then arrival."""

    heap: list[tuple[float, int, Envelope]] = attrs.Factory(list)
    changed: anyio.Event = attrs.Factory(anyio.Event)
    pushed: int = 0

    def push(self, due: float, envelope: Envelope) -> None:
        # Arrival order, not seq, breaks ties: a manual delivery order must survive.
        self.pushed += 1
        heapq.heappush(self.heap, (due, self.pushed, envelope))
        self.changed.set()

    def pop_due(self, now: float) -> Envelope | None:
        if self.heap and self.heap[0][0] <= now:
            return heapq.heappop(self.heap)[2]
        return None

    def next_due(self) -> float:
        return self.heap[0][0] if self.heap else math.inf


class MemoryNetwork:
    """A seeded, fault-injecting network of in-memory endpoints (see the module docstring)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        drop_rate: float = 0.0,
        duplicate_rate: float = 0.0,
        delay: tuple[float, float] = (0.0, 0.0),
        reorder: bool = False,
        manual: bool = False,
        queue_size: int = 1000,
    ) -> None:
        for name, rate in (("drop_rate", drop_rate), ("duplicate_rate", duplicate_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(name, rate, "a probability within [0, 1]")
        if not 0.0 <= delay[0] <= delay[1]:
            raise ConfigError("delay", delay, "(low, high) seconds with 0 <= low <= high")
        _check_queue_size(queue_size)
        self.drop_rate = drop_rate
        self.duplicate_rate = duplicate_rate
        self.delay = delay
        self.reorder = reorder
        self.manual = manual
        self.queue_size = queue_size
        self._rng = random.Random(seed)
        self._seq = 0
        self._endpoints: dict[str, MemoryTransport] = {}
        self._cut: set[tuple[PeerId, PeerId]] = set()
        self._in_flight: dict[int, Envelope] = {}
        self._pending: Counter[tuple[PeerId, PeerId]] = Counter()
        self._trace: list[TraceEvent] = []

    # --- endpoints -----------------------------------------------------------------

    def endpoint(self, peer: PeerId | str, *, queue_size: int | None = None) -> MemoryTransport:
        """Open the endpoint of ``peer`` at :func:`address_of` ``(peer)``.

        ``queue_size`` bounds each of its outbound queues (default: the network's).
        A closed endpoint's address can be opened again: that is a peer restart.
        """
        address = address_of(peer)
        if address in self._endpoints:
            raise TransportError(f"address {address!r} is already in use")
        if queue_size is not None:
            _check_queue_size(queue_size)
        transport = MemoryTransport(self, PeerId(peer), queue_size or self.queue_size)
        self._endpoints[address] = transport
        return transport

    def _release(self, transport: MemoryTransport) -> None:
        if self._endpoints.get(transport.address) is transport:
            del self._endpoints[transport.address]
        for seq, envelope in list(self._in_flight.items()):
            if envelope.dst == transport.local:
                del self._in_flight[seq]
                self._forget(envelope, "dead")

    # --- links -----------------------------------------------------------------------

    def partition(self, *groups: Iterable[PeerId | str]) -> None:
        """Cut every link, both ways, between peers of different groups.

        Peers named in no group keep their links. Cuts add up until :meth:`heal`.
        """
        sets = [{PeerId(p) for p in group} for group in groups]
        for i, group in enumerate(sets):
            for other in sets[i + 1 :]:
                for a in group:
                    for b in other:
                        self._cut.update({(a, b), (b, a)})

    def cut(self, src: PeerId | str, dst: PeerId | str) -> None:
        """Cut the one-way link from ``src`` to ``dst``."""
        self._cut.add((PeerId(src), PeerId(dst)))

    def restore(self, src: PeerId | str, dst: PeerId | str) -> None:
        """Restore the one-way link from ``src`` to ``dst``."""
        self._cut.discard((PeerId(src), PeerId(dst)))

    def heal(self) -> None:
        """Restore every link."""
        self._cut.clear()

    def link_up(self, src: PeerId | str, dst: PeerId | str) -> bool:
        """Whether messages from ``src`` to ``dst`` currently get through."""
        return (PeerId(src), PeerId(dst)) not in self._cut

    # --- observation -----------------------------------------------------------------

    @property
    def in_flight(self) -> tuple[Envelope, ...]:
        """Copies sent but not yet delivered (manual mode), oldest first."""
        return tuple(self._in_flight.values())

    @property
    def trace(self) -> tuple[TraceEvent, ...]:
        """Every decision the network made, in order."""
        return tuple(self._trace)

    # --- pump (manual mode) ----------------------------------------------------------

    def deliver_one(self) -> Envelope | None:
        """Deliver one in-flight copy, subject to the seeded drop and duplicate rates.

        Picks a random copy when ``reorder`` is set, else the oldest. A duplicate
        stays in flight as a new copy. Returns the copy handled (delivered or lost),
        or ``None`` when nothing is in flight.
        """
        if not self._in_flight:
            return None
        if self.reorder:
            seq = self._rng.choice(list(self._in_flight))
        else:
            seq = next(iter(self._in_flight))
        envelope = self._in_flight[seq]
        if self._rng.random() < self.drop_rate:
            self.discard(envelope)
            return envelope
        if self._rng.random() < self.duplicate_rate:
            self._admit_copy(envelope, "duplicate", due=0.0)
        self.deliver(envelope)
        return envelope

    def deliver_all(self, limit: int = 1_000_000) -> int:
        """Call :meth:`deliver_one` until nothing is in flight (at most ``limit`` times)."""
        handled = 0
        while handled < limit and self.deliver_one() is not None:
            handled += 1
        return handled

    def deliver(self, envelope: Envelope) -> bool:
        """Deliver this in-flight copy now (no drop or duplicate draw); ``False`` if lost."""
        self._take(envelope)
        target = self._endpoints.get(address_of(envelope.dst))
        if target is None:
            self._forget(envelope, "dead")
            return False
        if not self.link_up(envelope.src, envelope.dst):
            self._forget(envelope, "cut")
            return False
        self._record("deliver", envelope)
        target._inbox.push(0.0, envelope)
        return True

    def discard(self, envelope: Envelope) -> None:
        """Lose this in-flight copy."""
        self._take(envelope)
        self._forget(envelope, "drop")

    def _take(self, envelope: Envelope) -> None:
        if self._in_flight.pop(envelope.seq, None) is None:
            raise ValueError(f"message {envelope.seq} is not in flight")

    # --- internals used by MemoryTransport -----------------------------------------

    def _send(self, sender: MemoryTransport, dst: PeerId, payload: bytes) -> None:
        key = (sender.local, dst)
        self._seq += 1
        envelope = Envelope(self._seq, sender.local, dst, payload)
        if self._pending[key] >= sender.queue_size:
            sender._dropped += 1
            self._record("overflow", envelope)
            return
        self._record("send", envelope)
        if not self.link_up(sender.local, dst):
            self._record("cut", envelope)
            return
        if self.manual:
            self._pending[key] += 1
            self._in_flight[envelope.seq] = envelope
            return
        if self._rng.random() < self.drop_rate:
            self._record("drop", envelope)
            return
        self._pending[key] += 1
        self._schedule(envelope)
        if self._rng.random() < self.duplicate_rate:
            self._admit_copy(envelope, "duplicate", due=None)

    def _admit_copy(self, original: Envelope, kind: TraceKind, due: float | None) -> None:
        """Add a network-made copy of ``original``; ``due=None`` schedules it (auto mode)."""
        key = (original.src, original.dst)
        if self._pending[key] >= self.queue_size:
            return
        self._seq += 1
        copy = attrs.evolve(original, seq=self._seq)
        self._record(kind, copy)
        self._pending[key] += 1
        if due is None:
            self._schedule(copy)
        else:
            self._in_flight[copy.seq] = copy

    def _schedule(self, envelope: Envelope) -> None:
        target = self._endpoints.get(address_of(envelope.dst))
        if target is None:
            self._forget(envelope, "dead")
            return
        low, high = self.delay
        wait = self._rng.uniform(low, high) if high > 0 else 0.0
        target._inbox.push(anyio.current_time() + wait if wait else 0.0, envelope)

    def _arrived(self, envelope: Envelope) -> bool:
        """Account for a copy leaving an inbox; ``False`` if its link was cut meanwhile."""
        self._pending[(envelope.src, envelope.dst)] -= 1
        if not self.manual and not self.link_up(envelope.src, envelope.dst):
            self._record("cut", envelope)
            return False
        if not self.manual:
            self._record("deliver", envelope)
        return True

    def _forget(self, envelope: Envelope, kind: TraceKind) -> None:
        self._pending[(envelope.src, envelope.dst)] -= 1
        self._record(kind, envelope)

    def _record(self, kind: TraceKind, envelope: Envelope) -> None:
        self._trace.append(TraceEvent(kind, envelope.seq, envelope.src, envelope.dst))


def _check_queue_size(queue_size: int) -> None:
    if queue_size < 1:
        raise ConfigError("queue_size", queue_size, "a positive number of messages")


class MemoryTransport:
    """One endpoint of a :class:`MemoryNetwork`; made by :meth:`MemoryNetwork.endpoint`."""

    def __init__(self, network: MemoryNetwork, local: PeerId, queue_size: int) -> None:
        self._network = network
        self._local = local
        self.queue_size = queue_size
        self._peers: dict[PeerId, PeerId] = {}
        self._inbox = _Inbox()
        self._dropped = 0
        self._closed = False

    @property
    def local(self) -> PeerId:
        return self._local

    @property
    def address(self) -> str:
        """Where peers reach this endpoint (give it to their ``add_peer``)."""
        return address_of(self._local)

    @property
    def dropped(self) -> int:
        return self._dropped

    def add_peer(self, peer: PeerId, address: str) -> None:
        self._check_open()
        if not address.startswith(ADDRESS_SCHEME) or len(address) == len(ADDRESS_SCHEME):
            log.warning("refusing address %r for peer %r: not a memory address", address, peer)
            raise TransportError(f"not a memory transport address: {address!r}")
        self._peers[peer] = PeerId(address[len(ADDRESS_SCHEME) :])

    def remove_peer(self, peer: PeerId) -> None:
        target = self._peers.pop(peer, None)
        if target is None:
            return
        for envelope in self._network.in_flight:
            if envelope.src == self._local and envelope.dst == target:
                self._network.discard(envelope)

    async def send(self, peer: PeerId, payload: bytes) -> None:
        self.send_nowait(peer, payload)

    def send_nowait(self, peer: PeerId, payload: bytes) -> None:
        """``send`` without an event loop (for step-by-step tests)."""
        self._check_open()
        target = self._peers.get(peer)
        if target is None:
            raise UnknownPeerError(peer)
        # bytes() copies mutable buffers, so no sender-side change reaches the receiver.
        self._network._send(self, target, bytes(payload))

    def receive_nowait(self) -> tuple[PeerId, bytes] | None:
        """The next message that is due, or ``None``; never waits."""
        self._check_open()
        while self._inbox.heap:
            due = self._inbox.next_due()
            # Manual deliveries are due at 0, so no clock (and no event loop) is needed.
            envelope = self._inbox.pop_due(anyio.current_time() if due > 0 else 0.0)
            if envelope is None:
                return None
            if self._network._arrived(envelope):
                return envelope.src, envelope.payload
        return None

    async def receive(self) -> tuple[PeerId, bytes]:
        while True:
            message = self.receive_nowait()
            if message is not None:
                # Yield without a cancellation point: the message is already taken.
                await anyio.lowlevel.cancel_shielded_checkpoint()
                return message
            changed = self._inbox.changed = anyio.Event()
            wait = self._inbox.next_due() - anyio.current_time()
            with anyio.move_on_after(wait):
                await changed.wait()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._network._release(self)
        for _due, _seq, envelope in self._inbox.heap:
            self._network._forget(envelope, "dead")
        self._inbox.heap.clear()
        self._inbox.changed.set()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"transport {self._local!r} is closed")
