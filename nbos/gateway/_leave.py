"""What an agent told to stop does: leave at once, or once the gateway emptied its host.

Swarm stops an agent's task with SIGTERM (then SIGKILL after the service's
``stop_grace_period``) both when its node is drained (``docker node update
--availability drain``: the node is leaving, its replicas must move) and in a rolling
upgrade (``docker service update --image``: the next agent takes the replicas back, so
none should move). The agent cannot tell which: only a manager knows a node's
availability. So on SIGTERM it asks the gateway (:class:`~nbos.core.wire.agent.AgentLeaving`,
every heartbeat) and the :class:`LeaveAdvisor` answers
(:class:`~nbos.core.wire.agent.LeaveAdvice`):

* no swarm manager known to the gateway (``[gateway] swarm_engine`` empty), the node
  not found, or found ``active``: go now, replicas keep running;
* the node ``drain`` (or ``pause``): wait; the gateway drains the host as the
  autoscaler's scale-in does (:func:`~nbos.gateway._autoscale.empty_host`: unschedulable,
  every replica moved off by a Raft membership change), then says go and forgets the
  host (its silence from then on is nobody's failure);
* a host the autoscaler is draining already: wait until it is done.

The verdict holds for that agent incarnation (a later SIGTERM of a later agent asks
again). An agent that hears nothing goes after a few heartbeats (a gateway that is down
cannot move anything): its replicas keep running and the gateway, back, finds them
or, after its failure detector, replaces them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc

from nbos.backends.swarm import SwarmNodes
from nbos.core.errors import BackendError
from nbos.core.ids import HostId
from nbos.core.wire.agent import LeaveAdvice
from nbos.gateway._autoscale import empty_host
from nbos.gateway._directory import HostDirectory
from nbos.gateway._kernel_manager import KernelManager

log = logging.getLogger(__name__)

_DRAINING = ("drain", "pause")


class LeaveAdvisor:
    """Answers agents told to stop; ``nodes``: the swarm manager's node API (``None``: go)."""

    def __init__(
        self,
        directory: HostDirectory,
        kernel_manager: KernelManager,
        nodes: SwarmNodes | None,
        tg: anyio.abc.TaskGroup,
        *,
        period: float,
        busy: Callable[[HostId], bool] = lambda _: False,
    ) -> None:
        self._directory = directory
        self._kernel_manager = kernel_manager
        self._nodes = nodes
        self._tg = tg
        self._period = period
        self._busy = busy
        #: The verdict for each (host, agent incarnation) asked about.
        self._verdicts: dict[tuple[HostId, str], LeaveAdvice] = {}

    def advise(self, host: HostId, incarnation: str) -> LeaveAdvice:
        if self._busy(host):
            return LeaveAdvice(host, True, "the autoscaler is draining the host")
        key = (host, incarnation)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            return verdict
        if self._nodes is None:
            return LeaveAdvice(host, False, "no swarm manager known: replicas stay")
        for old in [k for k in self._verdicts if k[0] == host]:
            del self._verdicts[old]  # an earlier agent's
        verdict = self._verdicts[key] = LeaveAdvice(host, True, "asking the swarm manager")
        self._tg.start_soon(self._decide, key, self._nodes)
        return verdict

    async def _decide(self, key: tuple[HostId, str], nodes: SwarmNodes) -> None:
        host = key[0]
        try:
            node = await nodes.named(host)
        except BackendError as exc:
            log.warning(
                "host %s stops; its node's availability is unknown (%s): not drained", host, exc
            )
            self._verdicts[key] = LeaveAdvice(host, False, "swarm manager unreachable")
            return
        if node is None or node.availability not in _DRAINING:
            state = node.availability if node is not None else "not a swarm node"
            log.info("host %s stops, its node %s: replicas stay for the next agent", host, state)
            self._verdicts[key] = LeaveAdvice(host, False, f"node {state}: replicas stay")
            return
        self._verdicts[key] = LeaveAdvice(host, True, "node draining: moving replicas off")
        await self._drain(key)

    async def _drain(self, key: tuple[HostId, str]) -> None:
        host = key[0]
        started = anyio.current_time()
        log.info("host %s: its swarm node is drained, moving its replicas off", host)
        try:
            await empty_host(self._directory, self._kernel_manager, host, self._period)
        except KeyError:
            log.info("host %s went away while its node drained", host)
        else:
            log.info(
                "host %s emptied in %.1f s: its agent may go", host, anyio.current_time() - started
            )
        done = self._verdicts[key] = LeaveAdvice(host, False, "host emptied")
        await self._directory.tell(host, done)
        self._directory.remove(host)
