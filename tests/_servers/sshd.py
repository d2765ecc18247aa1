"""Start and stop a throwaway OpenSSH server on a free loopback port.

A fixture wraps it with :func:`tests._servers._process.serve_or_skip`, which skips
the test when there is no usable sshd (:class:`SshdUnavailableError`).

Everything lives in ``workdir``: a fresh host key and client key (``ssh-keygen``),
``authorized_keys``, a ``known_hosts`` file naming the host key, the config, the
pid file and the log. The server listens on 127.0.0.1 only, accepts only the
client key, and is stopped by the PID this module started.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tests._servers._process import (
    ServerUnavailableError,
    start_on_free_port,
    stop_process,
    wait_ready,
)

BINARY = "/usr/sbin/sshd"
# sshd refuses to start without its privilege separation directory.
_PRIVSEP_DIR = Path("/run/sshd")


class SshdUnavailableError(ServerUnavailableError):
    """No usable ``sshd`` or ``ssh-keygen`` here: tests that need one should skip."""


@dataclass
class SshServer:
    """A running sshd and the files a client needs to log in to it."""

    port: int
    process: subprocess.Popen[bytes]
    user: str
    client_key: Path
    known_hosts: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def session_pids(self) -> list[int]:
        """PIDs of the per-connection ``sshd`` processes this server forked (not user commands)."""
        return [pid for pid in _descendants(self.pid) if _comm(pid) == "sshd"]

    def vanish(self) -> None:
        """SIGKILL the listener and every per-connection sshd: the host "disappears".

        Commands the sessions started keep running (they are in sessions of their own).
        """
        sessions = self.session_pids()
        self.process.kill()
        self.process.wait()
        for pid in sessions:
            _kill_quietly(pid)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the listener and its sessions (SIGTERM, then SIGKILL) and reap it."""
        sessions = self.session_pids()
        stop_process(self.process, timeout_s)
        for pid in sessions:
            _kill_quietly(pid)


def start_sshd(
    workdir: Path,
    ready_timeout_s: float = 10.0,
    *,
    address: str = "127.0.0.1",
    where: Callable[[Sequence[str]], list[str]] = list,
) -> SshServer:
    """Generate keys and a config in ``workdir``, start sshd and wait for its banner.

    ``address`` is where it listens; ``where`` wraps its argv to run it elsewhere (in
    a network namespace, whose address only its log then says it listens on).

    Raises :class:`SshdUnavailableError` when sshd or ssh-keygen is missing, ``RuntimeError``
    when the server does not come up (the message quotes its log).
    """
    keygen = shutil.which("ssh-keygen")
    if keygen is None or not os.access(BINARY, os.X_OK):
        raise SshdUnavailableError(
            "sshd/ssh-keygen are not installed (apt-get install openssh-server)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    _keygen(keygen, workdir / "host_ed25519")
    _keygen(keygen, workdir / "client_ed25519")
    shutil.copy(workdir / "client_ed25519.pub", workdir / "authorized_keys")
    _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    probe = _banner if address == "127.0.0.1" else partial(_listening, address)
    return start_on_free_port(
        "sshd",
        lambda port: _launch(workdir, port, address, where),
        lambda server: wait_ready(server.process, lambda: probe(server), ready_timeout_s, 0.05),
    )


def _keygen(keygen: str, path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def _launch(
    workdir: Path, port: int, address: str, where: Callable[[Sequence[str]], list[str]]
) -> SshServer:
    config = workdir / f"sshd-{port}.conf"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"ListenAddress {address}",
                f"HostKey {workdir / 'host_ed25519'}",
                f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
                f"PidFile {workdir / f'sshd-{port}.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "StrictModes no",
                "UsePAM no",
                "",
            ]
        )
    )
    host_key = (workdir / "host_ed25519.pub").read_text().split()
    known_hosts = workdir / "known_hosts"
    known_hosts.write_text(f"[{address}]:{port} {host_key[0]} {host_key[1]}\n")
    log = workdir / f"sshd-{port}.log"
    with log.open("ab") as log_file:
        process = subprocess.Popen(
            where([BINARY, "-D", "-e", "-f", str(config)]),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return SshServer(
        port=port,
        process=process,
        user=getpass.getuser(),
        client_key=workdir / "client_ed25519",
        known_hosts=known_hosts,
        log=log,
    )


def _listening(address: str, server: SshServer) -> bool:
    return f"Server listening on {address} port {server.port}" in server.log.read_text()


def _banner(server: SshServer) -> bool:
    with socket.create_connection(("127.0.0.1", server.port), timeout=1.0) as s:
        return s.recv(64).startswith(b"SSH-")


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces.
    return [stat[stat.index("(") + 1 : stat.rindex(")")], *stat[stat.rindex(")") + 2 :].split()]


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[2]) if fields else None


def _comm(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
