"""Start and stop a throwaway ``jupyter lab`` on a free loopback port.

Its kernels are either the local kernelspecs Jupyter finds (the ``nbos``
kernelspec, installed into a ``JUPYTER_PATH`` the caller sets) or, given a
:class:`Gateway`, those of a remote Kernel Gateway (``--gateway-url``): the one
switch between the two. Config, data, runtime and settings go to ``workdir``, so
nothing of the user's Jupyter setup leaks in, and the lab fetches no news or
updates (the network is closed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._servers._process import (
    ServerUnavailableError,
    start_on_free_port,
    stop_process,
    wait_ready,
)


@dataclass(frozen=True)
class Gateway:
    """A Kernel Gateway that the lab's kernels come from (``--gateway-url``)."""

    url: str
    auth_token: str = ""


@dataclass
class JupyterLab:
    """A running ``jupyter lab``; ``url`` is its base URL, ``token`` its auth token."""

    port: int
    token: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def page(self, path: str) -> str:
        """The browser URL of ``path`` (e.g. ``lab/tree/x.ipynb``), token included."""
        return f"{self.url}/{path}?token={self.token}"

    def api(self, path: str) -> Any:
        """``GET /api/{path}``, decoded from JSON."""
        request = urllib.request.Request(
            f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server (it shuts its kernels down), SIGKILL after ``timeout_s``."""
        stop_process(self.process, timeout_s)


def start_jupyter_lab(
    workdir: Path, root_dir: Path, *, gateway: Gateway | None = None, ready_timeout_s: float = 60.0
) -> JupyterLab:
    """Start ``jupyter lab`` serving ``root_dir`` and wait until its API answers.

    Raises :class:`ServerUnavailableError` if JupyterLab is not installed,
    ``RuntimeError`` (quoting its log) if it does not come up.
    """
    if importlib.util.find_spec("jupyterlab") is None:
        raise ServerUnavailableError("jupyterlab is not installed (pip install jupyterlab)")
    workdir.mkdir(parents=True, exist_ok=True)
    return start_on_free_port(
        "jupyter lab",
        lambda port: _launch(workdir, root_dir, port, gateway),
        lambda lab: wait_ready(lab.process, lambda: _answers(lab), ready_timeout_s, 0.2),
    )


def _launch(workdir: Path, root_dir: Path, port: int, gateway: Gateway | None) -> JupyterLab:
    token = secrets.token_hex(16)
    args = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
        "--ServerApp.allow_root=True",
        "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
        "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
    ]  # fmt: skip
    if gateway is not None:
        # A replicated kernel starts slower than a local one: more than the default 42 s
        # on a busy machine.
        args += [f"--gateway-url={gateway.url}", "--GatewayClient.request_timeout=120"]
        if gateway.auth_token:
            args.append(f"--GatewayClient.auth_token={gateway.auth_token}")
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(workdir / "config"),
        "JUPYTER_DATA_DIR": str(workdir / "data"),
        "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(workdir / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(workdir / "workspaces"),
    }
    # No news toast in the page (it would cover the notebook in screenshots).
    notification = workdir / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True, exist_ok=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    log = workdir / f"jupyter-lab-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return JupyterLab(port=port, token=token, process=process, log=log)


def _answers(lab: JupyterLab) -> bool:
    return "started" in lab.api("status")
