"""Transports: the in-memory network (tests, simulator) and ZeroMQ (real deployments).

Both implement :class:`nbos.core.transport.Transport`.
"""

from nbos.transport.memory import Envelope, MemoryNetwork, MemoryTransport, TraceEvent
from nbos.transport.zmq import CurveKeys, ZmqTransport

__all__ = [
    "CurveKeys",
    "Envelope",
    "MemoryNetwork",
    "MemoryTransport",
    "TraceEvent",
    "ZmqTransport",
]
