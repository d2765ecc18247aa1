"""A real transport's peer in its own process: echoes every message back to its sender.

Usage: python echo_peer.py KIND LOCAL BIND PEER PEER_ADDRESS, KIND ``zmq`` or ``tcp``.
Prints its bound address on one line once it is ready.
"""

from __future__ import annotations

import sys

import anyio

from nbos.core.ids import PeerId
from nbos.transport import TcpTransport, ZmqTransport


async def main(kind: str, local: str, bind: str, peer: str, peer_address: str) -> None:
    opener = TcpTransport.open if kind == "tcp" else ZmqTransport.open
    async with await opener(local, bind) as transport:
        transport.add_peer(PeerId(peer), peer_address)
        print(transport.address, flush=True)
        while True:
            sender, payload = await transport.receive()
            await transport.send(sender, payload)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:6])
