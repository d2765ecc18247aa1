"""A client of the gateway inside a network namespace, driven line by line from stdin.

Run as ``python -m tests.gateway._netns_client ADDRESS`` where the gateway's control
address is reachable (nothing outside the namespaces reaches their addresses). Each
stdin line is a JSON command; each answer one JSON line on stdout:

* ``{"op": "status"}``: the gateway's ``ClusterStatus``;
* ``{"op": "start", "gpus": N}``: a new kernel's ``KernelInfo`` (kept for cells);
* ``{"op": "usage"}``: the gateway's ``Usage`` (every cell's wait and run times);
* ``{"op": "cell", "code": C}``: the cell's status and stdout, through a Jupyter
  client on the front of the kernel started last, or of ``"kernel": ID`` if given;
  with ``"shown": true``, the text of its displays too.
"""

from __future__ import annotations

import json
import sys

import anyio
import msgspec

from nbos.gateway.control_api import KernelInfo, StartKernel, StatusRequest, UsageRequest
from tests.gateway._service import ask, run_cell


async def main(address: str) -> None:
    kernels: dict[str, KernelInfo] = {}
    last = ""
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        command = json.loads(line)
        answer: object
        if command["op"] == "status":
            answer = await ask(address, StatusRequest())
        elif command["op"] == "usage":
            answer = await ask(address, UsageRequest())
        elif command["op"] == "start":
            answer = await ask(address, StartKernel(gpus=command["gpus"]))
            if isinstance(answer, KernelInfo):
                kernels[answer.kernel_id] = answer
                last = answer.kernel_id
        else:
            kernel = kernels[command.get("kernel", last)]
            answer = await run_cell(kernel, command["code"], shown=command.get("shown", False))
        sys.stdout.write(msgspec.json.encode(answer).decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
