"""The host agent: one per host, owning that host's GPU pool and serving the gateway.

Start one with :meth:`HostAgent.serve`; the messages it speaks are in
:mod:`nbos.core.wire.agent` and the protocol is described in ``docs/placement.md``.
"""

from nbos.agent._agent import EvictHook, HostAgent, reservation_message

__all__ = ["EvictHook", "HostAgent", "reservation_message"]
