"""Which transport a Raft group's member opens: the one decision, made here."""

from __future__ import annotations

from nbos.core.ids import PeerId
from nbos.transport.tcp import TcpTransport
from nbos.transport.zmq import CurveKeys, ZmqTransport


async def open_transport(
    local: PeerId | str, bind: str, *, curve: CurveKeys | None = None
) -> TcpTransport | ZmqTransport:
    """An endpoint for ``local`` at ``bind``: ZeroMQ with CURVE when ``curve`` is given,
    else plain TCP on the event loop, which costs a third of ZeroMQ's round trip
    (:mod:`nbos.transport.tcp`). Both take ``tcp://host:port`` addresses."""
    if curve is not None:
        return await ZmqTransport.open(local, bind, curve=curve)
    return await TcpTransport.open(local, bind)
