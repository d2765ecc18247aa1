"""How the backend tests reach the throwaway sshd: an ``SshHost`` for it."""

from __future__ import annotations

from pathlib import Path

from nbos.backends.ssh import SshHost
from tests._servers.sshd import SshServer


def ssh_target(server: SshServer, known_hosts: Path | None = None) -> SshHost:
    """The ``SshHost`` that logs in to ``server`` with its client key.

    ``known_hosts`` replaces the file that names the server's host key.
    """
    return SshHost(
        address="127.0.0.1",
        port=server.port,
        user=server.user,
        key_file=str(server.client_key),
        known_hosts=str(known_hosts or server.known_hosts),
    )
