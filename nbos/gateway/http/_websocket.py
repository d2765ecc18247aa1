"""``/api/kernels/{id}/channels``: a client's WebSocket, bridged to the kernel's channels.

The token is checked before the upgrade, an unknown kernel is a 404 then. The
``v1.kernel.websocket.jupyter.org`` subprotocol is chosen when the client offers
it, else the legacy JSON protocol (what Jupyter Server's gateway client speaks). A
frame that is not a message is logged and dropped; the connection goes on.

The connection sends with ``TCP_NODELAY``: a cell's messages are small frames written one
by one as the kernel sends them (``busy``, ``execute_input``, the reply, ``idle``), and
with Nagle's algorithm every frame after the first waited for the client's delayed ACK,
40 ms on Linux, in every cell (tornado turns Nagle back on once the upgrade's response
is written). Each frame is one write, so a message never leaves in pieces.

The connection counts the bytes it was given and the socket has not taken yet (its
:attr:`~KernelChannels.backlog`): the bridge drops output for a client whose backlog is
over the bound, so that a client that reads slowly holds a bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from tornado import websocket

from nbos.core.errors import DecodeError, KernelError
from nbos.gateway.auth import Authenticator
from nbos.gateway.http._channels import ChannelBridge
from nbos.gateway.http._handlers import RedactedLogs, api_errors, authenticate, error_body
from nbos.gateway.http._kernels import ApiKernel, ApiKernels
from nbos.gateway.http._wsproto import V1_PROTOCOL, WireMsg, decode, encode

log = logging.getLogger(__name__)

#: A WebSocket close frame's reason holds at most this many bytes (RFC 6455).
_MAX_REASON = 120


class KernelChannels(RedactedLogs, websocket.WebSocketHandler):
    kernels: ApiKernels
    authenticator: Authenticator
    api: ApiKernel
    bridge: ChannelBridge | None = None
    protocol = ""
    #: Bytes delivered and not yet written to the client's socket.
    backlog = 0

    def initialize(self, kernels: ApiKernels, authenticator: Authenticator) -> None:
        self.kernels = kernels
        self.authenticator = authenticator

    async def prepare(self) -> None:
        user = await authenticate(self, self.authenticator)
        with api_errors():
            self.api = self.kernels.get(self.path_kwargs["kernel_id"], user)

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        return V1_PROTOCOL if V1_PROTOCOL in subprotocols else None

    async def open(self, *args: str, **kwargs: str) -> None:
        self.set_nodelay(True)
        self.protocol = self.selected_subprotocol or ""
        session_key = self.get_query_argument("session_id", "")
        try:
            # A kernel still starting (waiting for a host): what the client sends waits too.
            await self.api.wait_started()
        except KernelError as exc:
            log.warning("kernel %s: client not connected: %s", self.api.kernel_id, exc)
            self.close(1011, str(exc).encode()[:_MAX_REASON].decode(errors="ignore"))
            return
        with api_errors():
            self.bridge = await self.kernels.connect(self.api, self, session_key)
        self.api.touch()
        log.info(
            "kernel %s: client connected (session %s, %s)",
            self.api.kernel_id,
            session_key or "-",
            self.protocol or "JSON",
        )

    async def on_message(self, message: str | bytes) -> None:
        if self.bridge is None:
            return
        try:
            msg = decode(message, self.protocol)
        except DecodeError as exc:
            log.warning("kernel %s: client message dropped: %s", self.api.kernel_id, exc)
            return
        self.api.touch()
        await self.bridge.send(msg)

    def on_close(self) -> None:
        if self.bridge is not None:
            self.kernels.disconnect(self.api, self)
            self.bridge = None

    # --- Sink --------------------------------------------------------------------

    def deliver(self, msg: WireMsg, header: Mapping[str, Any]) -> bool:
        frame = encode(msg, dict(header), self.protocol)
        try:
            written = self.write_message(frame.data, binary=not frame.text)
        except websocket.WebSocketClosedError:
            return False
        size = len(frame.data)
        self.backlog += size
        written.add_done_callback(lambda done: self._written(done, size))
        return True

    def _written(self, done: asyncio.Future[None], size: int) -> None:
        if not done.cancelled():
            done.exception()  # a closed connection's: on_close deals with it
        self.backlog -= size

    def close(self, code: int | None = None, reason: str | None = None) -> None:
        self.bridge = None
        super().close(code, reason)

    def get_compression_options(self) -> dict[str, Any] | None:
        return None

    def check_xsrf_cookie(self) -> None:
        """Token auth only: no cookies here."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.finish(error_body(self, kwargs))
