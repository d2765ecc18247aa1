"""Cells through a kernel's front, as any Jupyter client runs them: one client, one cell
at a time, the result as the client saw it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, cast

import anyio
import attrs
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.connect import KernelConnectionInfo


@attrs.frozen
class ExecuteResult:
    """What one cell did, as a client saw it.

    ``outputs`` are the IOPub messages of the cell (``{"msg_type", "content"}``), in
    order, without ``status``; ``executor`` is the node id of the replica that ran
    it (``None`` when it never ran); ``wait_s`` is how long it waited for the cell
    before it (its claim included), ``run_s`` how long it ran, ``commit_s`` how long
    capturing and committing its state took, ``round_trip_s`` the client's whole wait.
    """

    status: str
    execution_count: int | None
    outputs: tuple[Mapping[str, Any], ...]
    executor: int | None
    wait_s: float | None
    run_s: float | None
    commit_s: float | None
    round_trip_s: float
    reply: Mapping[str, Any]

    @property
    def stdout(self) -> str:
        """Everything the cell printed to stdout."""
        return "".join(
            o["content"]["text"]
            for o in self.outputs
            if o["msg_type"] == "stream" and o["content"].get("name") == "stdout"
        )

    @property
    def error(self) -> tuple[str, str] | None:
        """``(ename, evalue)`` of a failed cell, else ``None``."""
        if self.status != "error":
            return None
        return str(self.reply.get("ename", "")), str(self.reply.get("evalue", ""))


class CellClient:
    """A Jupyter client on the kernel whose connection info is ``connection``, connected on
    the first cell; cells sent together run one after the other."""

    def __init__(self, connection: Mapping[str, Any]) -> None:
        self._connection = dict(connection)
        self._client: AsyncKernelClient | None = None
        self._lock = anyio.Lock()

    async def execute(
        self, code: str, *, timeout: float, metadata: Mapping[str, Any] | None = None
    ) -> ExecuteResult:
        """Run ``code``; ``TimeoutError`` after ``timeout`` seconds without its reply and idle."""
        async with self._lock:
            client = self._connected()
            begun = time.monotonic()
            if metadata is None:
                msg_id = client.execute(code, allow_stdin=False, stop_on_error=False)
            else:
                msg_id = _send_execute(client, code, metadata)
            with anyio.fail_after(timeout):
                outputs = await _collect_outputs(client, msg_id)
                reply = await _reply_to(client, msg_id)
            meta = reply.get("metadata", {}).get("nbos", {})
            content = reply["content"]
            return ExecuteResult(
                status=content.get("status", "error"),
                execution_count=content.get("execution_count"),
                outputs=tuple(outputs),
                executor=meta.get("replica"),
                wait_s=meta.get("wait_s"),
                run_s=meta.get("run_s"),
                commit_s=meta.get("commit_s"),
                round_trip_s=time.monotonic() - begun,
                reply=content,
            )

    def close(self) -> None:
        if self._client is not None:
            self._client.stop_channels()
            self._client = None

    def _connected(self) -> AsyncKernelClient:
        if self._client is None:
            client = AsyncKernelClient()
            client.load_connection_info(cast(KernelConnectionInfo, self._connection))
            # No heartbeat channel: execute() needs none, and its pings every 3 s would
            # keep an idle kernel's front busy for nothing.
            client.start_channels(hb=False)
            self._client = client
        return self._client


def _send_execute(client: AsyncKernelClient, code: str, metadata: Mapping[str, Any]) -> str:
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }
    msg = client.session.msg("execute_request", content, metadata=dict(metadata))
    client.shell_channel.send(msg)
    return str(msg["header"]["msg_id"])


async def _collect_outputs(client: AsyncKernelClient, msg_id: str) -> list[dict[str, Any]]:
    outputs: list[dict[str, Any]] = []
    while True:
        msg = await client.get_iopub_msg()
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "idle":
                return outputs
            continue
        outputs.append({"msg_type": msg["msg_type"], "content": msg["content"]})


async def _reply_to(client: AsyncKernelClient, msg_id: str) -> dict[str, Any]:
    while True:
        reply: dict[str, Any] = await client.get_shell_msg()
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
