"""Reach a Docker engine for tests: the system one, or a private ``dockerd`` started here.

A fixture wraps it with :func:`tests._servers._process.serve_or_skip`, which skips
the test when no engine can run here (:class:`DockerdUnavailableError`); then
:func:`import_empty_image` gives the image to run.

If a daemon answers on ``/var/run/docker.sock`` it is used (and never stopped).
Otherwise, as root, a private ``dockerd`` runs with its own socket, data root,
exec root and pid file under ``workdir``, without iptables or a bridge
(containers use the host network); :meth:`DockerDaemon.stop` stops it by the PID
this module started and unmounts what it left under ``workdir``.

No image can be pulled here, so :func:`import_empty_image` makes one from an
empty tarball: containers bind-mount the host's ``/usr``, ``/lib*``, ``/bin``,
``/etc`` (and whatever else they need) read-only.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from importlib.metadata import distribution
from pathlib import Path

from tests._servers._process import ServerUnavailableError, stop_process, wait_ready

REPO = Path(__file__).resolve().parents[2]
SYSTEM_SOCKET = Path("/var/run/docker.sock")
EMPTY_IMAGE = "nbos-test-empty:latest"


class DockerdUnavailableError(ServerUnavailableError):
    """No Docker engine can run here: tests that need one should skip."""


@dataclass
class DockerDaemon:
    """A Docker engine reachable at ``socket``; ``process`` is set when this module started it."""

    socket: Path
    process: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None
    log: Path | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One HTTP request to the engine API; returns the status and the body."""
        conn = _UnixHTTPConnection(self.socket)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def answers(self) -> bool:
        try:
            return self.request("GET", "/_ping") == (200, b"OK")
        except OSError:
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the daemon this module started (SIGTERM, then SIGKILL) and unmount its leftovers."""
        if self.process is None or self._stopped:
            return
        self._stopped = True
        stop_process(self.process, timeout_s)
        if self.workdir is not None:
            _unmount_under(self.workdir)


def start_dockerd(
    workdir: Path, ready_timeout_s: float = 30.0, *, private: bool = False
) -> DockerDaemon:
    """The system engine if it answers (and not ``private``), else a private ``dockerd``
    (needs root) in ``workdir``.

    Raises :class:`DockerdUnavailableError` when neither works (the message says why,
    quoting the daemon's log).
    """
    system = DockerDaemon(SYSTEM_SOCKET)
    if not private and SYSTEM_SOCKET.is_socket() and system.answers():
        return system
    binary = shutil.which("dockerd")
    if binary is None:
        raise DockerdUnavailableError("dockerd is not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        raise DockerdUnavailableError("no Docker engine answers and starting dockerd needs root")
    workdir.mkdir(parents=True, exist_ok=True)
    daemon, process = _launch(binary, workdir)
    if wait_ready(process, daemon.answers, ready_timeout_s, 0.1):
        return daemon
    daemon.stop()
    log = daemon.log.read_text()[-2000:] if daemon.log else ""
    raise DockerdUnavailableError(f"dockerd did not come up here; its log:\n{log}")


def import_empty_image(daemon: DockerDaemon, tag: str = EMPTY_IMAGE) -> str:
    """Create ``tag`` from an empty root file system (no pull); returns the tag."""
    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w"):
        pass
    repo, _, version = tag.rpartition(":")
    status, body = daemon.request(
        "POST", f"/images/create?fromSrc=-&repo={repo}&tag={version}", tarball.getvalue()
    )
    if status != 200 or b'"error"' in body:
        raise RuntimeError(f"importing {tag} failed: {status} {body[-500:]!r}")
    return tag


def docker_mounts(*writable: Path) -> list[str]:
    """Read-only host system dirs, this interpreter, its environment, the repository and the
    nbos it runs (an editable install may be another checkout); ``writable`` read-write:
    what a container of :func:`import_empty_image`'s image needs to run nbos."""
    system = [p for p in ("/usr", "/lib", "/lib64", "/bin", "/etc") if Path(p).exists()]
    url = json.loads(distribution("nbos").read_text("direct_url.json") or "{}").get("url", "")
    editable = [url.removeprefix("file://")] if url.startswith("file://") else []
    read_only = dict.fromkeys([*system, sys.base_prefix, sys.prefix, str(REPO), *editable])
    return [f"{p}:{p}:ro" for p in read_only] + [f"{p}:{p}" for p in writable]


def _launch(binary: str, workdir: Path) -> tuple[DockerDaemon, subprocess.Popen[bytes]]:
    sock = workdir / "docker.sock"
    log = workdir / "dockerd.log"
    args = [
        binary,
        f"--host=unix://{sock}",
        f"--data-root={workdir / 'data'}",
        f"--exec-root={workdir / 'exec'}",
        f"--pidfile={workdir / 'dockerd.pid'}",
        "--iptables=false",
        "--bridge=none",
    ]
    with log.open("ab") as log_file:
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )
    return DockerDaemon(sock, process, workdir, log), process


def _unmount_under(workdir: Path) -> None:
    prefix = f"{workdir.resolve()}/"
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    # Deepest first, so a mount is never busy because of one inside it.
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._path))
        self.sock = sock
