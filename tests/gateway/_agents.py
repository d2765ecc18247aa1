"""The gateway's side of real ``nbos agent`` processes: a host directory and agent backend."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import attrs

from nbos.agent import address_ip
from nbos.backends.workdir import WORKDIR_TOKEN
from nbos.core.compute_backend import ProcessSpec
from nbos.gateway import AgentBackend, HostDirectory
from nbos.transport import ZmqTransport
from nbos.transport.keys import KeyDirectory

#: The agents' heartbeat (tests/agent/_daemons.start_agent) and how many may be missed.
HEARTBEAT_S = 0.2
MISSED = 25


@attrs.frozen
class GatewaySide:
    directory: HostDirectory
    backend: AgentBackend

    @property
    def address(self) -> str:
        return self.directory.transport.address

    @property
    def ip(self) -> str:
        return address_ip(self.address)


@asynccontextmanager
async def gateway_side(
    keys: Path | None, bind: str = "tcp://127.0.0.1:0", missed: int = MISSED
) -> AsyncIterator[GatewaySide]:
    key_dir = KeyDirectory(keys) if keys is not None else None
    curve = key_dir.gateway_curve() if key_dir is not None else None
    async with (
        await ZmqTransport.open("gateway", bind, curve=curve) as transport,
        HostDirectory.serve(
            transport,
            keys=key_dir,
            heartbeat_interval=HEARTBEAT_S,
            missed_heartbeats=missed,
            replicas_per_kernel=1,
        ) as directory,
        anyio.create_task_group() as tg,
    ):
        backend = await AgentBackend.open(directory, tg)
        yield GatewaySide(directory, backend)
        await backend.aclose()
        tg.cancel_scope.cancel()


def single_replica(kernel_id: str, raft: str, store: str) -> ProcessSpec:
    """A one-replica kernel (its own Raft group) that binds the host's address."""
    argv = [
        sys.executable,
        "-m",
        "nbos.kernel.replica",
        "--connection-file",
        f"{WORKDIR_TOKEN}/connection.json",
        "--kernel-id",
        kernel_id,
        "--node-id",
        "1",
        "--raft-peers",
        json.dumps({1: raft}),
        "--store",
        store,
        "--data-dir",
        f"{WORKDIR_TOKEN}/raft",
        "--HistoryManager.hist_file=:memory:",
        "--ReplicaApp.virtual_gpus=True",
    ]
    return ProcessSpec(argv, label=f"{kernel_id}-replica-1")
