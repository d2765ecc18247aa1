"""Fixtures for the state tests: a real local object store and an executor/replica pair."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from jupyter_client import AsyncKernelClient

from nbos.cluster import Kernel, LocalCluster
from nbos.core.wire import encode
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import StateCapture, _codec, apply, namespace_digest
from nbos.store.local import LocalObjectStore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def kernel(cluster: LocalCluster) -> AsyncIterator[Kernel]:
    """A kernel of its own on the module's ``cluster`` (each module defines that fixture)."""
    k = await cluster.start_kernel()
    try:
        yield k
    finally:
        await k.shutdown()


@asynccontextmanager
async def connected_client(kernel: Kernel) -> AsyncIterator[AsyncKernelClient]:
    """A Jupyter client on ``kernel``'s front for the block, its channels stopped after."""
    client = AsyncKernelClient()
    client.load_connection_info(kernel.connection_info)
    client.start_channels()
    try:
        yield client
    finally:
        client.stop_channels()


@asynccontextmanager
async def replica_client(
    cluster: LocalCluster, kernel: Kernel, node: int
) -> AsyncIterator[AsyncKernelClient]:
    """A Jupyter client on replica ``node`` itself (not the front), for the block."""
    client = AsyncKernelClient()
    client.load_connection_info(
        dict(cluster.kernel_manager.replica_connection(kernel.kernel_id, node))
    )
    client.start_channels()
    try:
        yield client
    finally:
        client.stop_channels()


async def replica_digest(client: AsyncKernelClient, after: int, *, timeout: float = 60) -> str:
    """The namespace digest of the replica ``client`` is connected to, once cell ``after``
    applied there."""
    msg = client.session.msg("nbos_digest_request", {"after": after})
    client.control_channel.send(msg)
    with anyio.fail_after(timeout):
        while True:
            reply: dict[str, Any] = await client.get_control_msg()
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return str(reply["content"]["digest"])


async def start_cell(client: AsyncKernelClient, code: str) -> str:
    """Send ``code``; returns its msg_id once the cell is running."""
    msg_id: str = client.execute(code)
    with anyio.fail_after(20):
        while True:
            msg = await client.get_iopub_msg()
            mine = msg["parent_header"].get("msg_id") == msg_id
            if mine and msg["msg_type"] == "execute_input":
                return msg_id


async def reply_to(
    client: AsyncKernelClient, msg_id: str, *, timeout: float = 30
) -> dict[str, Any]:
    """The shell reply to request ``msg_id``; ``TimeoutError`` after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while True:
            reply: dict[str, Any] = await client.get_shell_msg()
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply


async def run_cells(kernel: Kernel, cells: list[str]) -> int:
    """Run ``cells`` in order, each must succeed; returns the executor of the last one."""
    for code in cells:
        result = await kernel.execute(code)
        assert result.status == "ok", result.reply
    assert result.executor is not None
    return result.executor


def fresh_namespace() -> dict[str, Any]:
    """What a kernel's user namespace starts with (plus IPython-like bookkeeping)."""
    return {
        "__name__": "__main__",
        "__builtins__": builtins,
        "_": None,
        "_i": "",
        "_i1": "x = 1",
        "_1": 1,
        "In": [""],
        "Out": {},
        "exit": None,
    }


@dataclass
class Pair:
    """An executor namespace and a replica namespace (different dicts) kept in sync."""

    store: LocalObjectStore
    capture: StateCapture
    executor: dict[str, Any] = field(default_factory=fresh_namespace)
    replica: dict[str, Any] = field(default_factory=fresh_namespace)
    deltas: list[StateDelta] = field(default_factory=list)

    async def cell(self, code: str) -> StateDelta:
        """Run ``code`` on the executor, capture, apply on the replica, check digests agree."""
        # dont_inherit: a cell does not get this module's `from __future__` flags.
        exec(compile(textwrap.dedent(code), "<cell>", "exec", dont_inherit=True), self.executor)
        delta = await self.capture.capture(self.executor, exec_index=len(self.deltas) + 1)
        self.deltas.append(delta)
        await apply(self.replica, delta, self.store)
        assert namespace_digest(self.replica) == namespace_digest(self.executor)
        return delta


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LocalObjectStore]:
    s = LocalObjectStore(tmp_path / "blobs")
    yield s
    await s.aclose()


@pytest.fixture
def pair(store: LocalObjectStore) -> Pair:
    return Pair(store, StateCapture(store))


async def sent_names(delta: StateDelta, store: LocalObjectStore) -> set[str]:
    """The names whose values ``delta`` carries (decoded the way a replica would)."""
    if not delta.set and delta.set_blob is None:
        return set()
    encoded = _codec.Encoded(delta.set, delta.set_blob, delta.blobs)
    return set(await _codec.decode(encoded, {}, store))


CHILD = Path(__file__).with_name("_replica_child.py")


def replay_in_child(pair: Pair, probe: str, tmp_path: Path) -> dict[str, Any]:
    """Apply ``pair``'s deltas in a fresh Python process, run ``probe`` there; its report."""
    deltas = tmp_path / "deltas.msgpack"
    deltas.write_bytes(msgspec.msgpack.encode([encode(d) for d in pair.deltas]))
    return replay_file_in_child(pair.store.root, deltas, probe, tmp_path)


def replay_file_in_child(store: Path, deltas: Path, probe: str, tmp_path: Path) -> dict[str, Any]:
    """Apply the encoded deltas in ``deltas`` in a fresh process, run ``probe``; its report."""
    probe_file = tmp_path / "probe.py"
    probe_file.write_text(textwrap.dedent(probe))
    return run_json([str(CHILD), str(store), str(deltas), str(probe_file)])


def run_json(args: list[str]) -> dict[str, Any]:
    """Run a Python script of this directory in a fresh process; the JSON it prints."""
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report
