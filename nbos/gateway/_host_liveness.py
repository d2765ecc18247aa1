"""The gateway's one failure detector for hosts: a host silent too long is *suspected*.

A suspected host is left out of placement and executor choice until it is heard from
again; nothing that runs there is stopped for it (see ``docs/kernel.md``). Suspicion is
a guess about the network and the host, made by a process that can itself be paused,
starved of CPU or see its clock jump: so the detector does not blame hosts for silence
it caused. Time during which its own checks came late (the gateway was stopped, its
event loop blocked) does not count as anybody's silence; the clock is the monotonic
one, which wall-clock jumps do not move.

How long a silence is suspicious adapts to each host, in the manner of an accrual
detector (Hayashibara et al.'s φ, as Cassandra and Akka use it): the configured timeout
is the pause any host may take, and on top of it a host whose heartbeats arrive
irregularly (a loaded machine, a busy network) gets ``z`` standard deviations of its
observed inter-arrival times, ``z`` being where the normal tail falls below
``10**-PHI``. A host that beats like a clock is suspected after the timeout; none is
given more than :data:`MAX_STRETCH` timeouts.

:class:`SilenceDetector` is that rule, with no clock and no I/O. The host directory runs
one over its registered agents' heartbeats; a scheduler that learns hosts from their
reports (no directory, as in the embedded cluster) runs one through :class:`HostLiveness`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable

import anyio

from nbos.core.ids import HostId
from nbos.gateway._hosts import HostRecord, Hosts
from nbos.metrics import ClusterEvent, events

log = logging.getLogger(__name__)

#: Checks per timeout: a silent host is suspected at most a quarter timeout late.
_CHECKS_PER_TIMEOUT = 4
#: The suspicion level: a silence as unlikely as 10**-PHI under a host's observed
#: heartbeat timing is suspected (plus the timeout's pause).
PHI = 8.0
_Z = statistics.NormalDist().inv_cdf(1.0 - 10.0**-PHI)
#: The most a host's jitter stretches its timeout: a dead host is suspected in time.
MAX_STRETCH = 6.0
#: How many of a host's last inter-arrival times make its estimate.
_WINDOW = 64


class SilenceDetector:
    """Which hosts have been silent for longer than their limit: ``timeout`` seconds
    and their jitter (see the module docstring).

    Call :meth:`heard` whenever a host is heard from and :meth:`silent` every
    :attr:`interval` seconds; both take the caller's clock. A call of :meth:`silent`
    that comes later than :attr:`interval` after the previous one shifts every host's
    last word forward by the delay: the hosts may have spoken meanwhile, unheard.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.interval = timeout / _CHECKS_PER_TIMEOUT
        self._heard: dict[HostId, float] = {}
        self._gaps: dict[HostId, deque[float]] = {}
        self._suspected: set[HostId] = set()
        self._own_delay = OwnDelay()

    def heard(self, host_id: HostId, now: float) -> None:
        """The host spoke at ``now``: whatever it was suspected of is over."""
        previous = self._heard.get(host_id)
        if previous is not None and now > previous and host_id not in self._suspected:
            self._gaps.setdefault(host_id, deque(maxlen=_WINDOW)).append(now - previous)
        self._heard[host_id] = now
        self._suspected.discard(host_id)

    def forget(self, host_id: HostId) -> None:
        """The host left the cluster: its silence means nothing any more."""
        self._heard.pop(host_id, None)
        self._gaps.pop(host_id, None)
        self._suspected.discard(host_id)

    def limit(self, host_id: HostId) -> float:
        """How long ``host_id`` may be silent before it is suspected (see the module)."""
        gaps = self._gaps.get(host_id)
        jitter = statistics.pstdev(gaps) if gaps is not None and len(gaps) > 1 else 0.0
        return min(self.timeout + _Z * jitter, MAX_STRETCH * self.timeout)

    def silent(self, now: float) -> list[tuple[HostId, float]]:
        """Hosts newly suspected at ``now``, each with how long it has been silent."""
        self._credit_own_delay(now)
        found = [
            (host_id, now - heard)
            for host_id, heard in self._heard.items()
            if host_id not in self._suspected and now - heard > self.limit(host_id)
        ]
        self._suspected.update(host_id for host_id, _ in found)
        return found

    def _credit_own_delay(self, now: float) -> None:
        late = self._own_delay.late(now, self.interval)
        if late > 0:
            for host_id, heard in self._heard.items():
                self._heard[host_id] = min(now, heard + late)


class OwnDelay:
    """How late a periodic check came: time the checker itself was stalled (stopped,
    starved, its loop blocked), which no silence it watches may include."""

    def __init__(self) -> None:
        self._checked: float | None = None

    def late(self, now: float, interval: float) -> float:
        """Seconds past ``interval`` since the previous check (0 at the first one)."""
        previous, self._checked = self._checked, now
        return 0.0 if previous is None else max(0.0, now - previous - interval)


class HostLiveness:
    """Suspects hosts whose agents stop reporting to a scheduler that has no host directory;
    run :meth:`run` in a task. A request an agent does not answer is suspicion too."""

    def __init__(self, hosts: Hosts, host_timeout: float, notify: Callable[[], None]) -> None:
        self._hosts = hosts
        self._detector = SilenceDetector(host_timeout)
        self._notify = notify

    async def run(self) -> None:
        while True:
            await anyio.sleep(self._detector.interval)
            for host_id, silence in self._detector.silent(anyio.current_time()):
                host = self._hosts.get(host_id)
                if host is not None:
                    self.suspect(host, f"no report for {silence:.1f} s")

    def suspect(self, host: HostRecord, why: str) -> None:
        if not host.suspected:
            self._hosts.set_suspected(host, True)
            log.warning(
                "host %s is suspected (%s): nothing new goes there until it reports again",
                host.host_id,
                why,
            )
            events().happened(
                ClusterEvent(
                    "host-suspected", f"host {host.host_id} is suspected: {why}", host=host.host_id
                )
            )
            self._notify()

    def reported(self, host: HostRecord) -> None:
        """The host's agent reported (its record is up to date): no longer suspected."""
        self._detector.heard(host.host_id, anyio.current_time())
        if host.suspected:
            log.info("host %s reports again", host.host_id)
            events().happened(
                ClusterEvent(
                    "host-returned", f"host {host.host_id} reports again", host=host.host_id
                )
            )
            self._hosts.set_suspected(host, False)

    def forget(self, host_id: HostId) -> None:
        self._detector.forget(host_id)
