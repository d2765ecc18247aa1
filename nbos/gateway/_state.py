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

Also kept: the **state id**, made when the file is first written, and its
**generation**, one more at every write; both tag every replica the gateway starts
(the agents keep them, ``ReplicaOwner``). A replica of no kernel of this file that
carries its id and a generation the file has reached was dropped from it (its kernel
shut down, the replica replaced, or its start never acknowledged: proof to stop it);
one that carries another id belongs to a state this gateway lost or never had, and one
of a later generation than the file's was started after the file was written (the file
is an older copy): those are adopted, or left running (:mod:`nbos.gateway._strays`).

And the kernels **starting**: a start is recorded (kernel id and hosts) before any of
its replicas starts, and becomes a kernel record once everything of it runs, the write
its answer waits for. A gateway restarted after a crash mid-start finds it there and
stops its replicas.

Writes are **group commits** (:class:`StateWriter`): a change asked to be written while
another write runs waits for it, and then one write holds every change made meanwhile,
which answers all their callers; a burst of kernel starts, each recorded twice, waited for
one whole-file write and fsync each, in turn, before. A caller still returns only once a
file holding its change is on disk; when that write fails, each of its callers tries again
(or raises :class:`~nbos.core.errors.StateWriteError` as its own write would).

A write goes to a temporary file in the same directory, is fsynced, renamed over
the state file and the directory fsynced: a crash leaves the old or the new
state, never a torn one; a write that fails (``ENOSPC``, ``EIO``) removes the
temporary file, leaves the state file as it was and raises
:class:`~nbos.core.errors.StateWriteError`. The file is JSON decoded strictly; one
that does not decode is refused with a :class:`~nbos.core.errors.ConfigError`
naming it rather than silently starting empty (which would orphan running kernels).
Version 1 (no state id, no starts) still loads; it gets a fresh state id.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from nbos.core.errors import ConfigError, StateWriteError

#: Bumped when a record changes incompatibly; another version is refused.
STATE_VERSION = 2
#: The versions this gateway reads (version 1: no state id, no starts).
_READABLE = (1, STATE_VERSION)


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
    """A kernel that runs: its GPUs per cell, its front, its replicas, the user it
    belongs to (``""``: nobody's but the admins', as a kernel from before users), and
    when it was started (UNIX seconds; 0: a record from before start times)."""

    kernel_id: str
    gpus: int
    front: FrontRecord
    replicas: list[ReplicaRecord]
    owner: str = ""
    started_at: float = 0.0


class StartRecord(_Record, frozen=True):
    """A kernel start not yet acknowledged: its replicas, on ``hosts``, are to be stopped
    should the gateway restart before it is (their agents know them by kernel id)."""

    kernel_id: str
    hosts: list[str]


def new_state_id() -> str:
    return uuid.uuid4().hex


class GatewayState(_Record, frozen=True):
    """The whole state file."""

    version: int = STATE_VERSION
    state_id: str = msgspec.field(default_factory=new_state_id)
    #: One more at every write: what a replica started after the file was written has more.
    generation: int = 0
    kernels: list[KernelRecord] = []
    starting: list[StartRecord] = []


class StateFile:
    """``path``, read and replaced whole; ``state_id`` and ``generation`` are the state's
    it holds (its last :meth:`load`'s; a fresh id and 0 before)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state_id = new_state_id()
        self.generation = 0

    def load(self) -> GatewayState:
        """The state last written; an empty one, of a new state id, if there is no file."""
        state = self._read()
        self.state_id, self.generation = state.state_id, state.generation
        return state

    def _read(self) -> GatewayState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return GatewayState(state_id=self.state_id)
        except OSError as exc:
            raise ConfigError(str(self.path), None, f"a readable state file ({exc})") from exc
        try:
            state = msgspec.json.decode(data, type=GatewayState)
        except msgspec.DecodeError as exc:
            raise ConfigError(str(self.path), None, f"a gateway state file ({exc})") from exc
        if state.version not in _READABLE:
            raise ConfigError(
                str(self.path), state.version, f"a gateway state file of version {STATE_VERSION}"
            )
        return msgspec.structs.replace(state, version=STATE_VERSION)

    def save(self, state: GatewayState) -> None:
        """Replace the file by ``state`` atomically and durably; on
        :class:`StateWriteError` the file is as it was."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self._write(tmp, state)
        except OSError as exc:
            # A full disk keeps no half-written copy: its space is the next write's.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StateWriteError(str(self.path), exc) from exc

    def _write(self, tmp: Path, state: GatewayState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
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


class StateWriter:
    """Writes ``file`` for callers that may ask at once: a group commit.

    ``generation``: the last one tried (a failed write leaves a gap); ``written``: the
    last one on disk (the file's own before the first write).
    """

    def __init__(self, file: StateFile) -> None:
        self.file = file
        self.generation = self.written = file.generation
        self._lock = anyio.Lock()
        # Changes asked to be written (each call of write made one, once in memory), and
        # how many of them the last write that succeeded held.
        self._asked = self._held = 0

    async def write(self, snapshot: Callable[[int], GatewayState]) -> None:
        """Return once a state taken by ``snapshot(generation)`` after the caller's change
        is on disk: this call's write, or one that began after it was called. Raises
        :class:`~nbos.core.errors.StateWriteError` when its own write fails."""
        self._asked += 1
        asked = self._asked
        async with self._lock:
            if self._held >= asked:
                return
            holds = self._asked
            self.generation += 1
            await anyio.to_thread.run_sync(self.file.save, snapshot(self.generation))
            self.written = self.generation
            self._held = holds
