"""Which of a kernel's replicas the front counts on: heartbeats, deaths, the majority.

A replica is alive until whoever runs it reports its exit, or it misses
``HeartbeatPolicy.misses`` heartbeats in a row, or it is removed (replaced). A
replica being added is on standby: reachable, but not counted, until activated.
Death listeners hear of every replica declared dead; the front is the first of them
(it ends the requests in flight there).

Missed heartbeats are suspicion, not proof: the replica may be slow, frozen or cut
off, or the front itself may have stalled. Such a replica is *unresponsive*: not used,
but still pinged, and used again as soon as it answers (it is a Raft member all along
and catches up by itself), unless it was replaced meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import anyio
import attrs
import zmq
import zmq.asyncio

from nbos.core.errors import ConfigError
from nbos.kernel.front._upstream import Upstream
from nbos.kernel.protocol import MIN_PING_TIMEOUT_S

log = logging.getLogger(__name__)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"heartbeat.{attribute.name}", value, "> 0")


@attrs.frozen
class HeartbeatPolicy:
    """How the front pings each replica's heartbeat socket, and when it gives up on one.

    A replica is dead after ``misses`` pings in a row got no echo within ``timeout_s``.
    The heartbeat runs on its own thread in the replica, so a long cell does not miss.

    An idle kernel (no client request and none in flight for ``idle_interval_s``) is
    pinged every ``idle_interval_s`` instead of every ``interval_s``, until the next
    request or a missed ping: a replica's process exit is reported at once by whoever
    runs it, so the pings only look for replicas that hang (``idle_interval_s`` at or
    below ``interval_s``: no back-off).

    Every value must be positive, and ``timeout_s`` at least
    :data:`~nbos.kernel.protocol.MIN_PING_TIMEOUT_S` (0.5 s): a replica runs a cell
    that follows its last one closely without checking the log again, on the promise
    that no front gives it up faster (:data:`~nbos.kernel.protocol.CLAIM_FRESH_S`).
    """

    interval_s: float = attrs.field(default=1.0, validator=_positive)
    timeout_s: float = attrs.field(default=2.0, validator=_positive)
    misses: int = attrs.field(default=3, validator=_positive)
    idle_interval_s: float = attrs.field(default=10.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        # A replica's early claim stands unchecked for CLAIM_FRESH_S on the promise that
        # no front gives a live replica up faster than this.
        if self.timeout_s < MIN_PING_TIMEOUT_S:
            raise ConfigError("heartbeat.timeout_s", self.timeout_s, f">= {MIN_PING_TIMEOUT_S}")


#: ``listener(replica, reason)``: a replica was declared dead.
DeathListener = Callable[[int, str], None]
#: ``answered(replica)``: an unresponsive replica answered a heartbeat.
AnswerListener = Callable[[int], None]


class Liveness:
    """The liveness of the replicas in ``upstreams`` (the front's map, read here only).

    ``busy()`` says whether a request is in flight: an idle kernel is pinged less often.
    """

    def __init__(
        self,
        kernel_id: str,
        upstreams: Mapping[int, Upstream],
        policy: HeartbeatPolicy,
        busy: Callable[[], bool],
    ) -> None:
        self._kernel_id = kernel_id
        self._upstreams = upstreams
        self._policy = policy
        self._busy = busy
        #: Replicas being added (replacements): reachable, but not used for cells yet.
        self._standby: set[int] = set()
        #: Replicas restarted in place whose probe has not passed yet (:meth:`held_back`).
        self._held_back: set[int] = set()
        self._listeners: list[DeathListener] = []
        #: Replicas declared dead on suspicion alone (missed heartbeats): pinged still.
        self._unresponsive: set[int] = set()
        #: Told when one of them answers (the front uses it again).
        self.answered: AnswerListener = lambda replica: None
        #: The kernel is being shut down: replicas that end from now on are expected to.
        self.closing = False
        #: When the last client request came (the start counts as one), and the event
        #: that ends the heartbeat watchers' idle pauses at the next one.
        self._last_request = anyio.current_time()
        self._request_came = anyio.Event()

    @property
    def alive(self) -> tuple[int, ...]:
        """Node ids of the replicas believed alive (standby and held back ones aside),
        ascending: those a request may go to."""
        return tuple(r for r in self._running() if r not in self._held_back)

    def _running(self) -> list[int]:
        return sorted(r for r, up in self._upstreams.items() if up.alive and r not in self._standby)

    @property
    def members(self) -> tuple[int, ...]:
        """Node ids of every replica, dead and standby ones too, ascending."""
        return tuple(sorted(self._upstreams))

    @property
    def voters(self) -> tuple[int, ...]:
        """Node ids of the replicas that count towards a majority (standby ones aside)."""
        return tuple(sorted(r for r in self._upstreams if r not in self._standby))

    @property
    def has_quorum(self) -> bool:
        """Whether a majority of the kernel's replicas is alive (its log can commit); one
        held back counts, its Raft member runs."""
        return len(self._running()) * 2 > len(self.voters)

    @contextmanager
    def held_back(self, replica: int) -> Iterator[None]:
        """No request goes to ``replica`` while the block runs, though it counts towards
        a majority: restarted in place, it is probed first (``Membership.revive``)."""
        self._held_back.add(replica)
        try:
            yield
        finally:
            self._held_back.discard(replica)

    def standby(self, replica: int) -> None:
        """``replica`` is being added: not counted until :meth:`activate`."""
        self._standby.add(replica)

    def activate(self, replica: int) -> bool:
        """Count ``replica``, on standby until now; whether it was."""
        if replica not in self._standby:
            return False
        self._standby.discard(replica)
        return True

    def forget(self, replica: int) -> None:
        """``replica`` is gone for good (the front drops its upstream too)."""
        self._standby.discard(replica)
        self._unresponsive.discard(replica)

    def revived(self, replica: int) -> None:
        """``replica`` is used again."""
        self._unresponsive.discard(replica)

    def on_dead(self, listener: DeathListener) -> None:
        """Call ``listener(replica, reason)`` whenever a replica is declared dead."""
        self._listeners.append(listener)

    def unresponsive(self, replica: int) -> bool:
        """Whether ``replica`` is left out on suspicion alone, and used again if it answers."""
        return replica in self._unresponsive

    def mark_dead(self, replica: int, reason: str, *, suspicion: bool = False) -> None:
        """Declare ``replica`` dead (once; a revival may make it alive again).

        ``suspicion``: only suspected (see the module docstring); else it is used again
        only when revived (restarted in place).
        """
        proven = not suspicion and replica in self._unresponsive
        if suspicion:
            self._unresponsive.add(replica)
        else:
            self._unresponsive.discard(replica)
        up = self._upstreams.get(replica)
        # Suspected before, proven now: what it kept (a cell in flight) ends now.
        if up is None or not (up.mark_dead() or proven):
            return
        level = logging.INFO if self.closing else logging.WARNING
        log.log(level, "kernel %s: replica %d is dead (%s)", self._kernel_id, replica, reason)
        for listener in self._listeners:
            listener(replica, reason)

    def request_seen(self) -> None:
        """A client request came: the kernel is not idle, ping at the busy pace again."""
        self._last_request = anyio.current_time()
        if self._request_came.statistics().tasks_waiting:
            self._request_came.set()
            self._request_came = anyio.Event()

    async def watch(self, up: Upstream) -> None:
        """Ping ``up`` while it is alive, and while it is unresponsive until it answers
        (a revival starts a new watcher).

        The watcher's REQ socket is its own, closed by nobody else: a receive pending on
        a zmq.asyncio socket that is closed ends in a bare ``CancelledError``, which
        would cancel every task of the front.
        """
        life = up.life

        def current() -> bool:
            return up.life == life and (up.alive or up.replica in self._unresponsive)

        misses = 0
        sock = up.new_heartbeat()
        try:
            while current():
                await self._pause(misses)
                if not current():
                    return
                if await _ping(up.replica, sock, self._policy.timeout_s):
                    misses = 0
                    if not up.alive and current():
                        self.answered(up.replica)
                        return
                    continue
                # A REQ socket that got no answer is stuck mid-exchange: start a fresh one.
                sock.close(0)
                sock = up.new_heartbeat()
                misses += 1
                # A watcher of an earlier life never counts against a revived replica.
                if misses == self._policy.misses and up.alive and current():
                    self.mark_dead(up.replica, f"{misses} heartbeats missed", suspicion=True)
        finally:
            sock.close(0)

    async def _pause(self, misses: int) -> None:
        """Wait until the next ping: longer while the kernel is idle (see HeartbeatPolicy)."""
        policy = self._policy
        idle = (
            misses == 0
            and policy.idle_interval_s > policy.interval_s
            and not self._busy()
            and anyio.current_time() - self._last_request >= policy.idle_interval_s
        )
        if not idle:
            await anyio.sleep(policy.interval_s)
            return
        with anyio.move_on_after(policy.idle_interval_s):
            await self._request_came.wait()


async def _ping(replica: int, sock: zmq.asyncio.Socket, timeout: float) -> bool:
    with anyio.move_on_after(timeout):
        try:
            await sock.send(b"ping")
            await sock.recv()
        except zmq.ZMQError as exc:
            log.debug("heartbeat of replica %d: %s", replica, exc)
        else:
            return True
    return False
