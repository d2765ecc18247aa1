"""``example-vms``: an example nbos host provider standing in for a cloud API.

Each "VM" is an ``nbos agent`` process on this machine, created within ``quota``
and named ``{prefix}N``; its agent registers with the gateway like any other.
nbos calls ``add_host`` when its autoscaler scales out and ``remove_host`` once it
drained the host; ``aclose`` when the gateway stops.
"""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import anyio.abc

from nbos.core.errors import BackendError
from nbos.core.host_provider import AgentCommand
from nbos.core.ids import HostId

log = logging.getLogger(__name__)

_STOP_S = 15.0


class ProcessVmProvider:
    """At most ``quota`` hosts at a time, each an agent process with virtual GPUs."""

    def __init__(self, quota: int = 2, prefix: str = "vm-") -> None:
        if quota < 1:
            raise ValueError(f"quota must be at least 1, not {quota}")
        self._quota = quota
        self._prefix = prefix
        self._numbers = itertools.count(1)
        self._vms: dict[HostId, anyio.abc.Process] = {}

    @property
    def name(self) -> str:
        return "example-vms"

    async def add_host(self, agent: AgentCommand) -> HostId:
        if len(self._vms) >= self._quota:
            raise BackendError(f"quota of {self._quota} VMs reached")
        host_id = HostId(f"{self._prefix}{next(self._numbers)}")
        root = Path(agent.data_dir or tempfile.mkdtemp(prefix="nbos-vms-")) / "vms"
        root.mkdir(parents=True, exist_ok=True)
        argv = agent.argv(host_id, "127.0.0.1:0", str(root / host_id), sys.executable, virtual=True)
        with (root / f"{host_id}.log").open("ab") as out:
            self._vms[host_id] = await anyio.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        log.info("created VM %s", host_id)
        return host_id

    async def remove_host(self, host_id: HostId) -> None:
        process = self._vms.pop(host_id, None)
        if process is None:
            return
        process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(_STOP_S) as scope:
            await process.wait()
        if scope.cancelled_caught:
            process.kill()
            await process.wait()
        log.info("deleted VM %s", host_id)

    async def aclose(self) -> None:
        for host_id in list(self._vms):
            await self.remove_host(host_id)
