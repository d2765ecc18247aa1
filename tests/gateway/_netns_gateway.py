"""The gateway's side in a network namespace: one single-replica kernel per host, a cell each.

Run as ``python -m tests.gateway._netns_gateway BIND KEYDIR STORE HOST...`` inside the
gateway's namespace (nothing outside the namespaces reaches their addresses). It
waits for the agents of HOST... to register, starts on each a one-replica kernel
whose ports its agent chose, fronts it at BIND's address, runs a cell through a
Jupyter client, and prints one JSON line per host: the replica's connection ``ip``,
its Raft address and the cell's output. Logs go to stderr.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
from pathlib import Path

import anyio
from jupyter_client.asynchronous.client import AsyncKernelClient

from nbos.core.ids import HostId
from nbos.kernel.front import KernelFront, ReplicaEndpoint
from tests.gateway._agents import GatewaySide, gateway_side, single_replica

_DEADLINE = 120.0


async def _kernel_on(gw: GatewaySide, host: HostId, store: str) -> dict[str, str]:
    (raft,) = await gw.backend.addresses(host, 1)
    spec = single_replica(f"k-{host}", raft, store)
    handle = await gw.backend.start_replica(
        host, spec, workdir=f"k-{host}/replica-1", connection_key=secrets.token_hex(16)
    )
    info = await gw.backend.connection_info(handle, timeout=_DEADLINE)
    front = KernelFront([ReplicaEndpoint(1, info)], kernel_id=f"k-{host}", ip=gw.ip)
    async with anyio.create_task_group() as tg:
        await tg.start(front.serve)
        client = AsyncKernelClient()
        client.load_connection_info(front.connection_info)
        client.start_channels()
        try:
            outputs: list[str] = []
            reply = await client.execute_interactive(
                "import os; print(os.environ['NBOS_HOST_ID'])",
                timeout=_DEADLINE,
                output_hook=lambda m: outputs.append(m["content"].get("text", "")),
            )
        finally:
            client.stop_channels()
        front.closing()
        tg.cancel_scope.cancel()
    await handle.terminate(grace=5.0)
    return {
        "host": host,
        "ip": str(info["ip"]),
        "raft": raft,
        "status": reply["content"]["status"],
        "stdout": "".join(outputs),
    }


async def main(bind: str, keys: str, store: str, hosts: list[str]) -> None:
    async with gateway_side(Path(keys), bind) as gw:
        await gw.directory.wait_for_hosts(len(hosts), timeout=_DEADLINE)
        for host in hosts:
            result = await _kernel_on(gw, HostId(host), store)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
