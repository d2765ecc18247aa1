"""A replica's working directory on its host, and the Jupyter connection file in it.

Whoever starts a replica process on a host (the embedded cluster on this
machine, an ``nbos agent`` on its own) gives it a directory there, named by a
relative path the gateway chooses (``KERNEL/replica-N``), and writes a seed
connection file with the address the host is reached at, the kernel's HMAC key and
ports picked below the ephemeral range (:mod:`nbos.transport.ports`): the kernel binds
them and writes the file back, and the starter reads it (:func:`read_connection_file`)
to tell the gateway. A replica restarted in place binds the same ports again, so they
must not be ports any outgoing connection may have taken meanwhile.

The seed file of a replica given its kernel's CURVE key pair in its environment (a
cluster with keys, :func:`~nbos.transport.keys.kernel_keys_env`) holds the pair too, as
Jupyter's ``curve_publickey`` and ``curve_secretkey``: the kernel's Jupyter sockets are
CURVE servers of the pair found there, and whoever reads the file, before the kernel
wrote it back or after, connects as a CURVE client of the same pair.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nbos.core.errors import ConfigError, TransportError
from nbos.core.private_files import private_dir, write_private
from nbos.transport.keys import take_kernel_keys
from nbos.transport.ports import free_ports

#: The token in a replica's argv that stands for its working directory.
WORKDIR_TOKEN = "{workdir}"
#: The token in a replica's argv that stands for the starter's Python interpreter.
PYTHON_TOKEN = "{python}"
CONNECTION_FILE = "connection.json"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


def workdir_path(root: Path, name: str) -> Path:
    """``root/name``, where ``name`` is 1 to 4 ``/``-separated safe names (no ``..``)."""
    parts = name.split("/")
    if not 0 < len(parts) <= 4 or not all(_PART.fullmatch(p) for p in parts):
        raise ConfigError("workdir", name, "1-4 '/'-separated names of letters, digits, _.-")
    return root.joinpath(*parts)


def expand_argv(argv: Sequence[str], workdir: Path, python: str = sys.executable) -> list[str]:
    """``argv`` with every :data:`WORKDIR_TOKEN` replaced by ``workdir`` and an argument
    that is :data:`PYTHON_TOKEN` by ``python`` (the host's interpreter, which has nbos)."""
    return [python if a == PYTHON_TOKEN else a.replace(WORKDIR_TOKEN, str(workdir)) for a in argv]


def seed_connection_file(
    workdir: Path, ip: str, key: str, env: Mapping[str, str] | None = None
) -> Path:
    """Write the seed connection file into ``workdir`` unless one is there; its path.

    ``env``: the replica's environment, whose kernel key pair (if any) goes in too;
    :class:`ConfigError` if that pair is malformed.

    One that is there belongs to an earlier run of the same replica (a restart in
    place), whose ports its clients already know: it is kept.
    """
    path = workdir / CONNECTION_FILE
    if path.exists():
        return path
    try:
        ports = free_ports(len(_CHANNELS), ip)
    except TransportError:  # an address this machine cannot bind: the kernel picks
        ports = [0] * len(_CHANNELS)
    info = {
        "transport": "tcp",
        "ip": ip,
        "key": key,
        "signature_scheme": "hmac-sha256",
        **{f"{c}_port": port for c, port in zip(_CHANNELS, ports, strict=True)},
    }
    curve = take_kernel_keys(dict(env or {}))  # a copy: the replica takes them from its own
    if curve is not None:
        info["curve_publickey"] = curve.public_key.decode()
        info["curve_secretkey"] = curve.secret_key.decode()
    private_dir(workdir)
    write_private(path, json.dumps(info).encode())  # it holds the kernel's key
    return path


def read_connection_file(workdir: Path) -> dict[str, Any] | None:
    """The connection info once the kernel wrote its ports, else ``None``."""
    try:
        info = json.loads((workdir / CONNECTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not all(info.get(f"{c}_port") for c in _CHANNELS):
        return None
    return info
