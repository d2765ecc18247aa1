"""The HTTP server: routes, TLS, the request size limit, the idle culler.

Tornado serves it on the gateway's own event loop (the one anyio runs), so the
handlers call the gateway's kernels directly.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import zmq.asyncio
from tornado import httpserver, netutil, web

from nbos.core.config import GatewaySettings
from nbos.core.errors import ConfigError, TransportError
from nbos.gateway._dashboard import Dashboard, EventLog
from nbos.gateway._kernel_manager import KernelManager
from nbos.gateway.auth import Authenticator
from nbos.gateway.control_api import HostStatus
from nbos.gateway.http import _dashboard as d
from nbos.gateway.http import _handlers as h
from nbos.gateway.http._kernels import ApiKernels
from nbos.gateway.http._websocket import KernelChannels

log = logging.getLogger(__name__)

#: A REST body above this is refused (400) before it is read: none needs more.
MAX_BODY_BYTES = 1 << 20
#: Pings find clients that vanished without closing (a cut network, a frozen laptop).
_PING_INTERVAL_S = 30.0

_KERNEL = r"/api/kernels/(?P<kernel_id>[^/]+)"


@attrs.frozen
class HttpApi:
    """A running API: where it listens (``http://`` or ``https://``), its kernels, and its
    dashboard (``None`` if it serves none)."""

    url: str
    kernels: ApiKernels
    dashboard: Dashboard | None = None


@attrs.frozen
class DashboardSources:
    """What the dashboard reads beyond the kernel manager: the gateway's account of its
    hosts, and the event log its events sink feeds."""

    host_status: Callable[[], Sequence[HostStatus]]
    event_log: EventLog


def http_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks a free one) as host and port."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("gateway.http_address", value, "HOST:PORT")
    return host, int(port)


def _dashboard_routes(settings: dict[str, Any]) -> list[Any]:
    return [
        (r"/dashboard", web.RedirectHandler, {"url": "/dashboard/"}),
        (r"/dashboard/api/state/?", d.DashboardState, settings),
        (r"/dashboard/api/feed/?", d.DashboardFeed, settings),
        (
            r"/dashboard/(.*)",
            d.DashboardFiles,
            {"path": str(d.STATIC), "default_filename": "index.html"},
        ),
    ]


def _tls(conf: GatewaySettings) -> ssl.SSLContext | None:
    if not conf.http_certfile:
        if conf.http_keyfile:
            raise ConfigError("gateway.http_keyfile", conf.http_keyfile, "set with http_certfile")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(conf.http_certfile, conf.http_keyfile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "gateway.http_certfile", conf.http_certfile, f"a PEM certificate ({exc})"
        ) from exc
    return context


@asynccontextmanager
async def serve_http(
    conf: GatewaySettings,
    kernel_manager: KernelManager,
    max_gpus: Callable[[], int],
    authenticator: Authenticator,
    dashboard: DashboardSources | None = None,
) -> AsyncIterator[HttpApi]:
    """Serve the Kernel Gateway API at ``conf.http_address`` until the block exits.

    ``max_gpus`` tells the GPU count of the cluster's largest host (the kernelspecs
    offered). With ``dashboard``, the dashboard is served at ``/dashboard/`` and its
    figures sampled from now on. Leaving closes the clients' channels; the kernels
    started through the API are the kernel manager's to shut down or leave running, as
    all its kernels.
    """
    host, port = http_address(conf.http_address)
    if conf.cull_idle_timeout < 0:
        raise ConfigError(
            "gateway.cull_idle_timeout", conf.cull_idle_timeout, "seconds, 0 for never"
        )
    tls = _tls(conf)
    ctx = zmq.asyncio.Context()
    try:
        async with anyio.create_task_group() as tg:
            kernels = ApiKernels(kernel_manager, tg, ctx, max_gpus, conf.client_backlog_mib * 2**20)
            kernels.take_back()
            settings = {"kernels": kernels, "authenticator": authenticator}
            board = None
            routes: list[Any] = []
            if dashboard is not None:
                board = Dashboard(
                    kernel_manager,
                    dashboard.host_status,
                    dashboard.event_log,
                    lambda: {
                        api.kernel.kernel_id: api.kernel_id for api in kernels if api.is_started
                    },
                )
                routes = _dashboard_routes({**settings, "dashboard": board})
                tg.start_soon(board.run)
            app = web.Application(
                [
                    *routes,
                    (r"/api/?", h.ApiRoot, settings),
                    (r"/api/kernelspecs/?", h.KernelSpecs, settings),
                    (r"/api/kernelspecs/(?P<name>[^/]+)/?", h.KernelSpec, settings),
                    (r"/api/kernels/?", h.Kernels, settings),
                    (_KERNEL + r"/?", h.KernelOne, settings),
                    (_KERNEL + r"/interrupt/?", h.KernelInterrupt, settings),
                    (_KERNEL + r"/restart/?", h.KernelRestart, settings),
                    (_KERNEL + r"/channels/?", KernelChannels, settings),
                ],
                websocket_ping_interval=_PING_INTERVAL_S,
                log_function=h.log_request,
            )
            server = httpserver.HTTPServer(app, ssl_options=tls, max_body_size=MAX_BODY_BYTES)
            try:
                sockets = netutil.bind_sockets(port, host)
            except OSError as exc:
                raise TransportError(f"cannot serve HTTP at {conf.http_address}: {exc}") from exc
            server.add_sockets(sockets)
            bound = sockets[0].getsockname()[1]
            scheme = "https" if tls else "http"
            shown = f"[{host}]" if ":" in host else host
            api = HttpApi(f"{scheme}://{shown}:{bound}", kernels, board)
            if conf.cull_idle_timeout > 0:
                tg.start_soon(kernels.cull_idle, conf.cull_idle_timeout)
            log.info("gateway: Kernel Gateway API at %s", api.url)
            try:
                yield api
            finally:
                server.stop()
                kernels.close()
                with anyio.CancelScope(shield=True):
                    await server.close_all_connections()
                tg.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
