"""The front's links to a replica with the kernel's CURVE keys: nothing of a cell in clear.

A replica runs as its own process; the front reaches its five Jupyter sockets only
through a tap, a TCP proxy per port that records every byte both ways. With the
kernel's keys a cell's source and output never show in what the tap saw; without keys
(the embedded default) they do, which shows the tap sees what it should. A plain
Jupyter client, even one that knows the replica's HMAC key, gets nothing from a replica
with keys.
"""

from __future__ import annotations

import functools
import queue
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.blocking.client import BlockingKernelClient

from nbos.backends.local import LocalProcessBackend
from nbos.backends.workdir import seed_connection_file
from nbos.core.compute_backend import ProcessSpec
from nbos.core.ids import HostId
from nbos.gateway import LocalLauncher
from nbos.kernel.front import KernelFront, ReplicaEndpoint
from nbos.transport.keys import kernel_keys_env
from nbos.transport.ports import LOOPBACK, free_loopback_ports
from tests.gateway._agents import single_replica

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

DEADLINE = 120.0
HMAC_KEY = "hmac-key-of-the-replica"
_CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
SOURCE_MARKER = b"SOURCE-MARKER-7f3a"
OUTPUT_MARKER = b"SNIFF-MARKER-xxx"
# The output marker is built by the cell, so only its output holds it whole.
CELL = f"print('SNIFF-MARKER-' + 'x'*3)  # {SOURCE_MARKER.decode()}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.define
class Tap:
    """Every byte that crossed the tapped links, both ways."""

    seen: bytearray = attrs.field(factory=bytearray)

    async def pump(self, source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
        try:
            async for chunk in source:
                self.seen += chunk
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            await sink.aclose()

    async def relay(self, target: int, client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                server = await anyio.connect_tcp("127.0.0.1", target)
            except OSError:
                return  # the replica does not listen yet: ZeroMQ connects again
            async with server, anyio.create_task_group() as tg:
                tg.start_soon(self.pump, client, server)
                tg.start_soon(self.pump, server, client)

    async def proxy(self, tg: anyio.abc.TaskGroup, target: int) -> int:
        """A port that forwards to ``target`` through this tap."""
        (port,) = free_loopback_ports(1)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
        tg.start_soon(listener.serve, functools.partial(self.relay, target))
        return port


@asynccontextmanager
async def replica(
    tmp_path: Path, *, keys: bool, plain_seed: bool = False
) -> AsyncIterator[Mapping[str, Any]]:
    """A one-replica kernel process (with a kernel key pair if ``keys``); its connection
    info. ``plain_seed``: its connection file was seeded without a key pair (by an earlier
    nbos, for a replica now restarted in place)."""
    if plain_seed:
        seed_connection_file(tmp_path / "kernels" / "k1" / "replica-1", LOOPBACK, HMAC_KEY)
    backend = LocalProcessBackend(["h1"], run_dir=tmp_path / "logs")
    launcher = LocalLauncher(backend, tmp_path / "kernels", virtual_gpus=True)
    (raft,) = await launcher.addresses(HostId("h1"), 1)
    spec = single_replica("k1", raft, str(tmp_path / "store"))
    env = kernel_keys_env() if keys else {}
    handle = await launcher.start_replica(
        HostId("h1"),
        ProcessSpec(spec.argv, env, spec.label),
        workdir="k1/replica-1",
        connection_key=HMAC_KEY,
    )
    try:
        yield await launcher.connection_info(handle, DEADLINE)
    finally:
        await handle.terminate(grace=5.0)
        await backend.aclose()


async def _run_tapped_cell(info: Mapping[str, Any]) -> tuple[str, bytes]:
    """Run :data:`CELL` through a front that reaches the replica of ``info`` through a
    tap; the cell's stdout and what the tap saw."""
    tap = Tap()
    async with anyio.create_task_group() as tg:
        tapped = dict(info)
        for channel in _CHANNELS:
            tapped[f"{channel}_port"] = await tap.proxy(tg, int(info[f"{channel}_port"]))
        front = KernelFront([ReplicaEndpoint(1, tapped)], kernel_id="k1")
        await tg.start(front.serve)
        client = AsyncKernelClient()
        client.load_connection_info(front.connection_info)
        client.start_channels()
        stdout: list[str] = []
        try:
            reply = await client.execute_interactive(
                CELL,
                timeout=DEADLINE,
                output_hook=lambda m: stdout.append(m["content"].get("text", "")),
            )
        finally:
            client.stop_channels()
        assert reply["content"]["status"] == "ok"
        front.closing()
        tg.cancel_scope.cancel()
    return "".join(stdout), bytes(tap.seen)


@pytest.mark.parametrize("keys", [True, False], ids=["keys", "no-keys"])
async def test_a_tap_between_front_and_replica_sees_a_cell_in_clear_only_without_keys(
    tmp_path: Path, keys: bool
) -> None:
    async with replica(tmp_path, keys=keys) as info:
        assert ("curve_secretkey" in info) == keys
        stdout, seen = await _run_tapped_cell(info)
    assert stdout == OUTPUT_MARKER.decode() + "\n"
    assert len(seen) > 1000  # the cell's whole round trip went through the tap
    if keys:
        assert SOURCE_MARKER not in seen
        assert OUTPUT_MARKER not in seen
        assert b"execute_request" not in seen
    else:
        assert SOURCE_MARKER in seen
        assert OUTPUT_MARKER in seen


def _reply(info: Mapping[str, Any], code: str | None, timeout: float) -> dict[str, Any] | None:
    """The replica's shell reply to a client of ``info`` (of the kernel's key pair where
    ``info`` holds one) asking to run ``code``, or for kernel info if ``None``; ``None``
    if none came within ``timeout`` seconds."""
    client = BlockingKernelClient()
    client.load_connection_info(dict(info))
    client.start_channels()
    try:
        msg_id = client.kernel_info() if code is None else client.execute(code)
        reply: dict[str, Any] = client.get_shell_msg(timeout=timeout)
    except queue.Empty:
        return None
    finally:
        client.stop_channels()
    assert reply["parent_header"]["msg_id"] == msg_id
    return reply


async def test_a_replica_with_keys_executes_nothing_for_a_plain_client(tmp_path: Path) -> None:
    proof = tmp_path / "ran"
    async with replica(tmp_path, keys=True) as info:
        # The right HMAC key, no CURVE.
        plain = {k: v for k, v in info.items() if not k.startswith("curve_")}
        code = f"open({str(proof)!r}, 'w').close()"
        assert await anyio.to_thread.run_sync(_reply, plain, code, 5.0) is None
        assert not proof.exists()
        # A client of the kernel's pair is answered: the replica was there all along.
        reply = await anyio.to_thread.run_sync(_reply, info, None, DEADLINE)
        assert reply is not None and reply["content"]["status"] == "ok"


async def test_a_replica_whose_connection_file_has_no_key_pair_keeps_plain_jupyter_sockets(
    tmp_path: Path,
) -> None:
    # Restarted in place after an upgrade, it must speak what its front (whose record
    # has no key pair either) speaks; its Raft port still has the kernel's keys.
    async with replica(tmp_path, keys=True, plain_seed=True) as info:
        assert "curve_secretkey" not in info
        reply = await anyio.to_thread.run_sync(_reply, info, None, DEADLINE)
        assert reply is not None and reply["content"]["status"] == "ok"
    log = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert "Jupyter sockets without CURVE" in log
