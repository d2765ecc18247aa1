"""Start and stop a throwaway JupyterHub on free loopback ports.

The Hub (PyPI ``jupyterhub``, with ``configurable-http-proxy`` from npm, which it starts
itself) lets in the users it is given with any password (``DummyAuthenticator``), and
has one service, ``nbos-test``, with the ``admin`` role: the tests act as the Hub's
admin through its REST API with :attr:`JupyterHub.admin_token` (make users' tokens,
revoke them, start and stop servers). Its database, cookie secret and log go to
``workdir``. ``config`` adds lines to its ``jupyterhub_config.py`` (the single-user
servers' spawner, for one).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests._servers._process import (
    ServerUnavailableError,
    free_port,
    start_on_free_port,
    stop_process,
    wait_ready,
)

#: The name of the test's own Hub service, the Hub's admin.
SERVICE = "nbos-test"


@dataclass
class JupyterHub:
    """A running Hub: ``url`` is its public URL (through its proxy), ``hub_url`` the Hub's
    own, ``api_url`` its REST API (what a single-user server gets as
    ``JUPYTERHUB_API_URL``)."""

    port: int
    hub_port: int
    admin_token: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hub_url(self) -> str:
        return f"http://127.0.0.1:{self.hub_port}"

    @property
    def api_url(self) -> str:
        return f"{self.hub_url}/hub/api"

    def api(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        """``METHOD /hub/api/{path}`` as the admin (or ``token``'s owner), decoded from JSON;
        ``urllib.error.HTTPError`` for an error status."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.api_url}/{path}",
            data=data,
            method=method,
            headers={"Authorization": f"token {token or self.admin_token}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = response.read()
        return json.loads(answer) if answer else None

    def new_token(self, user: str) -> tuple[str, str]:
        """A fresh API token of ``user``: the token and its id (to revoke it)."""
        model = self.api("POST", f"users/{user}/tokens", {"note": "nbos test"})
        return str(model["token"]), str(model["id"])

    def revoke(self, user: str, token_id: str) -> None:
        self.api("DELETE", f"users/{user}/tokens/{token_id}")

    def start_server(self, user: str, timeout_s: float) -> str:
        """Start ``user``'s single-user server and wait until the Hub says it is ready;
        its URL through the Hub's proxy."""
        self.api("POST", f"users/{user}/server")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            server = self.api("GET", f"users/{user}")["servers"].get("", {})
            if server.get("ready"):
                return f"{self.url}/user/{user}"
            if not server.get("pending"):
                raise RuntimeError(f"{user}'s server did not start; the Hub's log:\n{self._tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"{user}'s server not ready in {timeout_s} s:\n{self._tail()}")

    def stop_server(self, user: str) -> None:
        self.api("DELETE", f"users/{user}/server")

    def _tail(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the Hub (it stops its proxy and servers), SIGKILL after ``timeout_s``;
        then whatever it started that is still running (a Hub killed leaves its proxy)."""
        children: list[psutil.Process] = []
        if self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                children = psutil.Process(self.process.pid).children(recursive=True)
        stop_process(self.process, timeout_s)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


def start_jupyterhub(
    workdir: Path,
    *,
    users: tuple[str, ...] = ("alice", "bob"),
    admins: tuple[str, ...] = ("admin",),
    config: str = "",
    hub_port: int | None = None,
    ready_timeout_s: float = 90.0,
) -> JupyterHub:
    """Start a Hub that knows ``users`` and ``admins`` and wait until its API answers.

    ``hub_port``: the Hub's own port, if it must be known before (a free one if not).

    Raises :class:`ServerUnavailableError` if JupyterHub or its proxy is not installed,
    ``RuntimeError`` (quoting its log) if it does not come up.
    """
    if importlib.util.find_spec("jupyterhub") is None:
        raise ServerUnavailableError("jupyterhub is not installed (pip install jupyterhub)")
    if shutil.which("configurable-http-proxy") is None:
        raise ServerUnavailableError(
            "configurable-http-proxy is not installed (npm install -g configurable-http-proxy)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    return start_on_free_port(
        "jupyterhub",
        lambda port: _launch(workdir, port, hub_port or free_port(), users, admins, config),
        lambda hub: wait_ready(hub.process, lambda: _answers(hub), ready_timeout_s, 0.3),
    )


def _launch(
    workdir: Path,
    port: int,
    hub_port: int,
    users: tuple[str, ...],
    admins: tuple[str, ...],
    config: str,
) -> JupyterHub:
    proxy_api_port = free_port()
    admin_token = secrets.token_hex(32)
    config_file = workdir / f"jupyterhub_config_{port}.py"
    config_file.write_text(
        textwrap.dedent(f"""\
            c = get_config()  # noqa
            c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
            c.JupyterHub.hub_ip = "127.0.0.1"
            c.JupyterHub.hub_port = {hub_port}
            c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
            c.ConfigurableHTTPProxy.auth_token = {secrets.token_hex(32)!r}
            c.JupyterHub.db_url = "sqlite:///{workdir}/jupyterhub-{port}.sqlite"
            c.JupyterHub.cookie_secret = bytes.fromhex({secrets.token_hex(32)!r})
            c.JupyterHub.pid_file = "{workdir}/jupyterhub-{port}.pid"
            c.JupyterHub.authenticator_class = "dummy"
            c.Authenticator.allowed_users = {set(users)!r}
            c.Authenticator.admin_users = {set(admins)!r}
            c.JupyterHub.services = [{{"name": {SERVICE!r}, "api_token": {admin_token!r}}}]
            c.JupyterHub.load_roles = [{{"name": "admin", "services": [{SERVICE!r}]}}]
            c.JupyterHub.cleanup_servers = True
            """)
        + config
    )
    log = workdir / f"jupyterhub-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config_file), "--debug"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=os.environ.copy(),
        )
    return JupyterHub(port, hub_port, admin_token, process, log)


def _answers(hub: JupyterHub) -> bool:
    # The proxy's route to the Hub is added last: the Hub is ready when it answers there.
    try:
        with urllib.request.urlopen(f"{hub.url}/hub/api", timeout=5) as response:
            return "version" in json.load(response)
    except urllib.error.HTTPError:
        return False
