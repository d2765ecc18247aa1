"""A ZmqTransport peer in its own process: echoes every message back to its sender.

Usage: python echo_peer.py LOCAL BIND PEER PEER_ADDRESS
Prints its bound address on one line once it is ready.
"""

from __future__ import annotations

import sys

import anyio

from nbos.core.ids import PeerId
from nbos.transport import ZmqTransport


async def main(local: str, bind: str, peer: str, peer_address: str) -> None:
    async with await ZmqTransport.open(local, bind) as transport:
        transport.add_peer(PeerId(peer), peer_address)
        print(transport.address, flush=True)
        while True:
            sender, payload = await transport.receive()
            await transport.send(sender, payload)


if __name__ == "__main__":
    local, bind, peer, peer_address = sys.argv[1:5]
    anyio.run(main, local, bind, peer, peer_address)
