"""``/dashboard``: the gateway's dashboard page, and the data it shows, per user.

The page (``static/``: HTML, CSS and plain JavaScript, no build step) holds no data and
needs no token; it asks for one, keeps it in the tab's ``sessionStorage`` and sends it
as ``Authorization: token X`` on every request (no cookie: nothing another site could
make a browser send). The data needs a token as every endpoint does (401 without, 403
for a wrong one) and is the user's view (:meth:`~nbos.gateway._dashboard.Dashboard.view`):

* ``GET /dashboard/api/state``: the cluster now, the event log and the time series, once;
* ``GET /dashboard/api/feed``: the same, then pushed as server-sent events (``board``
  every :data:`PUSH_S` seconds, ``events`` and ``samples`` as they come), at most
  :data:`MAX_FEEDS` at once; its token is checked again every :data:`RECHECK_S` seconds,
  and the feed ends once it is refused.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
from tornado import iostream, web

from nbos.gateway._dashboard import Dashboard
from nbos.gateway.auth import Authenticator
from nbos.gateway.http._handlers import ApiHandler, authenticate
from nbos.gateway.http._kernels import ApiKernels

log = logging.getLogger(__name__)

#: The page's files.
STATIC = Path(__file__).parent / "static"
#: How often a feed pushes the cluster's state: the page is at most about this far behind.
PUSH_S = 0.5
#: Feeds open at once; one more is refused (503): each costs the gateway a little CPU.
MAX_FEEDS = 64
#: How often an open feed checks its token again: a user removed from the users file (or
#: no longer an admin) stops seeing what they no longer may within this time.
RECHECK_S = 30.0
#: The page may load only its own files and talk only to this gateway; no frame holds it.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class DashboardFiles(web.StaticFileHandler):
    """The page's files, with headers that keep it to itself."""

    def set_extra_headers(self, path: str) -> None:
        for name, value in _PAGE_HEADERS.items():
            self.set_header(name, value)
        self.set_header("Cache-Control", "no-cache")


class _DashboardData(ApiHandler):
    dashboard: Dashboard

    def initialize(  # type: ignore[override]
        self, kernels: ApiKernels, authenticator: Authenticator, dashboard: Dashboard
    ) -> None:
        super().initialize(kernels, authenticator)
        self.dashboard = dashboard
        self.set_header("Cache-Control", "no-store")

    def whole(self) -> dict[str, Any]:
        """Everything the user may see now: who they are, the board, events, series."""
        user = self.user
        return {
            "user": {"name": user.name, "role": user.role},
            "board": self.dashboard.view(user),
            "events": self.dashboard.events_for(user, 0),
            "samples": list(self.dashboard.samples),
        }


class DashboardState(_DashboardData):
    def get(self) -> None:
        self.reply(self.whole())


class DashboardFeed(_DashboardData):
    """Server-sent events: ``hello`` (what :class:`DashboardState` answers), then ``board``,
    ``events`` and ``samples`` as they change."""

    feeds = 0
    _closed = False

    async def get(self) -> None:
        if DashboardFeed.feeds >= MAX_FEEDS:
            raise web.HTTPError(503, f"{MAX_FEEDS} dashboard feeds are open, the most at once")
        DashboardFeed.feeds += 1
        try:
            await self._push()
        finally:
            DashboardFeed.feeds -= 1

    async def _push(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        dashboard, user = self.dashboard, self.user
        whole = self.whole()
        seq = dashboard.events.last_seq
        last_t = whole["samples"][-1].t if whole["samples"] else 0.0
        self._send("hello", whole)
        recheck = time.monotonic() + RECHECK_S
        while not self._closed:
            try:
                await self.flush()
            except iostream.StreamClosedError:
                return
            await anyio.sleep(PUSH_S)
            if time.monotonic() >= recheck:
                recheck = time.monotonic() + RECHECK_S
                try:
                    self.user = user = await authenticate(self, self.authenticator)
                except web.HTTPError:  # logged: the token was revoked meanwhile
                    return
            self._send("board", dashboard.view(user))
            events = dashboard.events_for(user, seq)
            seq = dashboard.events.last_seq
            if events:
                self._send("events", events)
            samples = dashboard.samples_since(last_t)
            if samples:
                last_t = samples[-1].t
                self._send("samples", samples)

    def _send(self, kind: str, data: Any) -> None:
        self.write(b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n")

    def on_connection_close(self) -> None:
        self._closed = True
