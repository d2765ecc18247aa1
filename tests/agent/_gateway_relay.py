"""A gateway endpoint as a process: relays between a real ZeroMQ endpoint and stdin/stdout.

Run as ``python -m tests.agent._gateway_relay BIND [KEYDIR]`` (inside a network
namespace when the test needs one). It opens the ``gateway`` endpoint at BIND
(with the gateway's CURVE keys from KEYDIR), prints ``{"address": ...}``, then:

* stdin lines ``{"op": "add_peer", "peer", "address", "key"}`` and
  ``{"op": "send", "peer", "data"}`` (base64 payload) act on the endpoint;
* every received message is printed as ``{"sender", "data"}``.

Logs (ZAP refusals among them) go to stderr. It ends when stdin closes.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
from pathlib import Path

import anyio

from nbos.core.ids import PeerId
from nbos.transport import ZmqTransport
from nbos.transport.keys import KeyDirectory


def _print(record: dict[str, str]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def _relay_out(transport: ZmqTransport) -> None:
    while True:
        sender, data = await transport.receive()
        _print({"sender": sender, "data": base64.b64encode(data).decode()})


async def _relay_in(transport: ZmqTransport) -> None:
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        command = json.loads(line)
        peer = PeerId(command["peer"])
        if command["op"] == "add_peer":
            key = command["key"].encode() or None
            transport.add_peer(peer, command["address"], server_key=key)
        else:
            await transport.send(peer, base64.b64decode(command["data"]))


async def main(bind: str, keys: str | None) -> None:
    curve = KeyDirectory(Path(keys)).gateway_curve() if keys else None
    async with await ZmqTransport.open("gateway", bind, curve=curve) as transport:
        _print({"address": transport.address})
        async with anyio.create_task_group() as tg:
            tg.start_soon(_relay_out, transport)
            await _relay_in(transport)
            tg.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    anyio.run(main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
