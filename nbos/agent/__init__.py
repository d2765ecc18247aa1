"""The host agent: one per host, owning that host's GPU pool and replica processes.

:class:`HostAgent` serves a GPU pool over any ``Transport`` (start one with
:meth:`HostAgent.serve`); :class:`AgentDaemon` is ``nbos agent``: a ``HostAgent``
plus the host's replica processes on a ZeroMQ endpoint, registered with the
gateway. The messages are in :mod:`nbos.core.wire.agent`; the GPU protocol is
described in ``docs/placement.md``, registration and replicas in ``docs/deploy.md``.
"""

from nbos.agent._agent import EVICT_TIMEOUT_S, EvictHook, HostAgent, reservation_message
from nbos.agent._daemon import (
    GATEWAY_PEER,
    AgentConfig,
    AgentDaemon,
    address_ip,
    agent_peer,
    run_until_signalled,
    tcp_address,
)
from nbos.agent._pids import ProcessIdentity, process_start_ticks

__all__ = [
    "EVICT_TIMEOUT_S",
    "GATEWAY_PEER",
    "AgentConfig",
    "AgentDaemon",
    "EvictHook",
    "HostAgent",
    "ProcessIdentity",
    "address_ip",
    "agent_peer",
    "process_start_ticks",
    "reservation_message",
    "run_until_signalled",
    "tcp_address",
]
