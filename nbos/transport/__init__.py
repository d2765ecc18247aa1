"""Transports: the in-memory network (tests, simulator), ZeroMQ (with CURVE) and plain
TCP (real deployments).

All implement :class:`nbos.core.transport.Transport`; :func:`open_transport` picks
between the real ones and :func:`received_messages` is the decoding receive loop
over any.
"""

from typing import TYPE_CHECKING

from nbos.core.lazy import lazy_exports
from nbos.transport._messages import received_messages
from nbos.transport._open import open_transport
from nbos.transport.tcp import TcpTransport
from nbos.transport.zmq import CurveKeys, ZmqTransport

if TYPE_CHECKING:
    from nbos.transport.memory import Envelope, MemoryNetwork, MemoryTransport, TraceEvent

# The in-memory network serves tests and the simulator: loaded on first use.
__getattr__ = lazy_exports(
    __name__,
    {"nbos.transport.memory": ("Envelope", "MemoryNetwork", "MemoryTransport", "TraceEvent")},
)

__all__ = [
    "CurveKeys",
    "Envelope",
    "MemoryNetwork",
    "MemoryTransport",
    "TcpTransport",
    "TraceEvent",
    "ZmqTransport",
    "open_transport",
    "received_messages",
]
