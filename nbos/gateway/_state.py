"""The gateway's durable state: its kernels, written atomically on each change.

A gateway with a ``[cluster] data_dir`` keeps ``DATA_DIR/gateway/state.json``:
every kernel that is not shut down, with what taking it back needs after a
``kill -9`` of the gateway:

* the front's ports, key and session id, so that clients reconnect to the same
  sockets and keep signing with the same key;
* each replica's host, its agent's replica id (the agent keeps the process; the
  new gateway adopts it), how it was started (to restart it in place: argv,
  environment, with the kernel's CURVE keys where it has some), its Raft
  address (for replacements) and its connection info (the front connects to it
  again).

The file holds secrets (HMAC and CURVE keys): it is written with mode ``0600``.

Not kept: which cell index comes next (the replicas' logs say, see
:meth:`~nbos.kernel.front.KernelFront.serve`), GPU grants (the agents report
their reservations), hosts (agents that speak to a gateway that does not know
them are asked to register).

A write goes to a temporary file in the same directory, is fsynced, renamed over
the state file and the directory fsynced: a crash leaves the old or the new
state, never a torn one. The file is JSON decoded strictly; one that does not
decode is refused with a :class:`~nbos.core.errors.ConfigError` naming it
rather than silently starting empty (which would orphan running kernels).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from nbos.core.errors import ConfigError

#: Bumped when a record changes incompatibly; another version is refused.
STATE_VERSION = 1


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class FrontRecord(_Record, frozen=True):
    """A kernel front's sockets and identity: the same ones after a restart."""

    ip: str
    shell_port: int
    iopub_port: int
    stdin_port: int
    control_port: int
    hb_port: int
    key: str
    session: str


class ReplicaRecord(_Record, frozen=True, omit_defaults=True):
    """One replica of a kernel: where it runs and how to reach, restart or replace it."""

    node: int
    host: str
    #: The launcher's id of the process (the agent's replica id).
    process: str
    workdir: str
    key: str
    argv: list[str]
    raft: str
    connection: dict[str, str | int]
    env: dict[str, str] = {}
    label: str = ""
    #: The address of the proposal forwarder that replicas had before forwarding moved
    #: into the Raft driver: read from an older gateway's file, never used or written.
    forward: str | None = None


class KernelRecord(_Record, frozen=True):
    """A kernel that runs: its GPUs per cell, its front, its replicas."""

    kernel_id: str
    gpus: int
    front: FrontRecord
    replicas: list[ReplicaRecord]


class GatewayState(_Record, frozen=True):
    """The whole state file."""

    version: int = STATE_VERSION
    kernels: list[KernelRecord] = []


class StateFile:
    """``path``, read and replaced whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> GatewayState:
        """The state last written; an empty one if there is no file yet."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return GatewayState()
        except OSError as exc:
            raise ConfigError(str(self.path), None, f"a readable state file ({exc})") from exc
        try:
            state = msgspec.json.decode(data, type=GatewayState)
        except msgspec.DecodeError as exc:
            raise ConfigError(str(self.path), None, f"a gateway state file ({exc})") from exc
        if state.version != STATE_VERSION:
            raise ConfigError(
                str(self.path), state.version, f"a gateway state file of version {STATE_VERSION}"
            )
        return state

    def save(self, state: GatewayState) -> None:
        """Replace the file by ``state`` atomically and durably."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        # It holds secrets (connection keys, kernels' CURVE keys): the owner's only.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a leftover temporary file keeps its mode through O_CREAT
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
