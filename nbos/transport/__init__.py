"""Transports: the in-memory network (tests, simulator) and ZeroMQ (real deployments).

Both implement :class:`nbos.core.transport.Transport`; :func:`received_messages`
is the decoding receive loop over either.
"""

from nbos.transport._messages import received_messages
from nbos.transport.memory import Envelope, MemoryNetwork, MemoryTransport, TraceEvent
from nbos.transport.zmq import CurveKeys, ZmqTransport

__all__ = [
    "CurveKeys",
    "Envelope",
    "MemoryNetwork",
    "MemoryTransport",
    "TraceEvent",
    "ZmqTransport",
    "received_messages",
]
