"""The replica kernel process: an ``IPKernelApp`` that joins its kernel's Raft group.

Run as ``python -m nbos.kernel.replica --connection-file F --kernel-id K --node-id N
--raft-peers JSON --store DIR|URL [--data-dir DIR] [--join] [--recover]``. ``--raft-peers``
maps every node id of the group to its Raft address; with ``--join`` the
replica starts empty and waits for the leader to add it as a learner (a replacement);
with ``--recover`` it ran before and restarts in place from the Raft state in
``--data-dir``, and exits with :data:`~nbos.kernel.protocol.RAFT_STATE_GONE_STATUS`
if that state is gone or damaged (its disk lost it) rather than start without it.
The kernel's CURVE key pair, when its cluster has keys, comes in the environment
(:func:`~nbos.transport.keys.take_kernel_keys`), never on the command line, for its Raft
port; and in its connection file (0600), as Jupyter's ``curve_publickey`` and
``curve_secretkey``, for its five Jupyter sockets: ipykernel makes each a CURVE server of
the pair found there, and a ZAP handler on each of their ZeroMQ contexts admits only
clients of the same pair (the front, which reads the pair from the same file). A replica
restarted in place keeps its connection file, and with it what its clients speak.

``python -m nbos.kernel.replica --warm`` is a pre-started replica (an agent's pool,
``docs/deploy.md``): it imports everything a replica needs, then waits for one
:class:`~nbos.core.wire.agent.WarmAssignment` line on its stdin and runs as the
replica it names; at end of file (its agent went away) it exits without a word.
``python -m nbos.kernel.replica --template`` is the process such pre-started replicas are
forked from (:mod:`nbos.kernel.replica._template`): each fork goes on as ``--warm`` would.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import zmq
from ipykernel.kernelapp import IPKernelApp, kernel_aliases, kernel_flags
from traitlets import Bool, Dict, DottedObjectName, Int, Type, Unicode, default
from zmq.auth.thread import ThreadAuthenticator

from nbos.core.config import RaftSettings
from nbos.core.errors import (
    ConfigError,
    NbosError,
    RaftStateMissingError,
    StorageCorruptError,
)
from nbos.core.ids import KernelId, NodeId
from nbos.core.object_store import ObjectStore
from nbos.core.private_files import keep_private
from nbos.core.wire.agent import TEMPLATE_FLAG, WARM_FLAG, WarmAssignment
from nbos.kernel.protocol import RAFT_STATE_GONE_STATUS
from nbos.kernel.replica._kernel import NoShellChannelThread, ReplicaKernel
from nbos.kernel.replica._member_thread import RaftMemberThread
from nbos.kernel.replica._session import ReplicaSession
from nbos.kernel.replica._template import import_startup_modules, serve_forks
from nbos.store.local import LocalObjectStore
from nbos.transport.keys import take_kernel_keys
from nbos.transport.ports import bind_port
from nbos.transport.zmq import CurveKeys, start_thread_authenticator

log = logging.getLogger(__name__)


def parse_peers(text: str) -> dict[NodeId, str]:
    """Decode ``--raft-peers``; raises :class:`ConfigError` for anything malformed.

    An older gateway gave each node ``[raft address, forwarder address]``; a replica it
    launched can still be restarted in place from that command line (the forwarder's
    address is ignored: proposals go over Raft now).
    """
    try:
        raw = msgspec.json.decode(text, type=dict[int, str | tuple[str, str]])
    except msgspec.MsgspecError as exc:
        raise ConfigError("raft-peers", text, f"JSON {{node: raft address}} ({exc})") from exc
    if not raw:
        raise ConfigError("raft-peers", text, "at least one peer")
    return {NodeId(n): a if isinstance(a, str) else a[0] for n, a in raw.items()}


def open_store(where: str) -> ObjectStore:
    """``--store``: a Redis URL (``redis://``, ``rediss://``, ``unix://``) or a directory.

    Replicas of one kernel run on several hosts and must share the store: a directory
    only where every host sees the same one, Redis across machines.
    """
    if where.startswith(("redis://", "rediss://", "unix://")):
        from nbos.store.redis import RedisObjectStore  # the optional redis extra

        return RedisObjectStore(where)
    return LocalObjectStore(Path(where))


def parse_raft_settings(text: str) -> RaftSettings:
    """Decode ``--raft-settings``; raises :class:`ConfigError` for anything malformed."""
    try:
        return msgspec.json.decode(text, type=RaftSettings)
    except msgspec.MsgspecError as exc:
        raise ConfigError("raft-settings", text, f"JSON of [raft] settings ({exc})") from exc


class ReplicaApp(IPKernelApp):
    """``IPKernelApp`` running a :class:`ReplicaKernel` joined to the kernel's log."""

    name = "nbos-replica"
    kernel_class = Type(ReplicaKernel, klass=ReplicaKernel)
    outstream_class = DottedObjectName("nbos.kernel.replica._output.ReplicaOutStream")
    kernel_id = Unicode("", help="The replicated kernel's id.").tag(config=True)
    node_id = Int(0, help="This replica's Raft node id.").tag(config=True)
    raft_peers = Unicode("", help="JSON {node id: Raft address}.").tag(config=True)
    store = Unicode("", help="The object store: a directory, or a Redis URL.").tag(config=True)
    data_dir = Unicode("", help="Directory of this replica's Raft log (empty: in memory).").tag(
        config=True
    )
    raft_settings = Unicode("{}", help="JSON of the kernel's [raft] settings.").tag(config=True)
    join = Bool(
        False, help="Join an existing group as a new member (a replacement), not found one."
    ).tag(config=True)
    recover = Bool(
        False, help="Restart in place from the Raft state in data_dir; refuse to start without it."
    ).tag(config=True)
    flags = Dict(
        {
            **kernel_flags,
            "join": ({"ReplicaApp": {"join": True}}, "Join an existing group."),
            "recover": ({"ReplicaApp": {"recover": True}}, "Restart from data_dir's Raft state."),
        }
    )
    virtual_gpus = Bool(
        False, help="The host's GPUs are virtual: bound devices keep tensors in host memory."
    ).tag(config=True)
    aliases = Dict(
        {
            **kernel_aliases,
            "connection-file": "ReplicaApp.connection_file",
            "kernel-id": "ReplicaApp.kernel_id",
            "node-id": "ReplicaApp.node_id",
            "raft-peers": "ReplicaApp.raft_peers",
            "store": "ReplicaApp.store",
            "data-dir": "ReplicaApp.data_dir",
            "raft-settings": "ReplicaApp.raft_settings",
        }
    )

    #: The kernel's CURVE key pair for its Raft port and for its Jupyter sockets (``None``:
    #: plain), and the ZAP handlers that admit only the latter to the Jupyter sockets.
    _raft_curve: CurveKeys | None = None
    _jupyter_curve: CurveKeys | None = None
    _authenticators: list[ThreadAuthenticator]

    @default("session")
    def _session_default(self) -> ReplicaSession:
        return ReplicaSession(parent=self)

    def init_sockets(self) -> None:
        self._authenticators = []
        self._raft_curve = take_kernel_keys(os.environ)
        # ipykernel read these from the connection file, and makes its sockets CURVE
        # servers of them (the heartbeat's too).
        if self.curve_secretkey is not None and self.curve_publickey is not None:
            self._jupyter_curve = CurveKeys(self.curve_secretkey, self.curve_publickey)
        elif self._raft_curve is not None:
            log.warning(
                "kernel %s: Jupyter sockets without CURVE, its connection file holds no key"
                " pair (seeded by an earlier nbos)",
                self.kernel_id,
            )
        super().init_sockets()  # type: ignore[no-untyped-call]
        # ipykernel 7 reads the shell on a thread of its own that routes requests to
        # subshells. The front offers none, so that thread would only add two thread
        # hops (and GIL hand-overs) to every request and its reply: the kernel's own
        # thread reads the shell instead.
        self.shell_channel_thread.io_loop.close()
        self.shell_channel_thread = NoShellChannelThread()

    def _bind_socket(self, s: zmq.Socket[Any], port: int) -> int:
        """Bind ``port``, seeded free below the ephemeral range; at a first start, one that
        another process took meanwhile gives way to another such port (nobody knows it
        yet). A replica restarted in place must have its own ports again: its clients
        know them."""
        self._admit_only_the_kernel(s.context)
        bind = partial(super()._bind_socket, s)
        return bind_port(bind, self.ip, port, keep=self.recover)

    def init_heartbeat(self) -> None:
        super().init_heartbeat()  # type: ignore[no-untyped-call]
        # Its context is made and bound in there; the heartbeat only echoes what it gets.
        assert self.heartbeat is not None
        self._admit_only_the_kernel(self.heartbeat.context)

    def _admit_only_the_kernel(self, context: zmq.Context[Any]) -> None:
        """Have ``context``'s CURVE servers admit only the kernel's key pair (with keys)."""
        curve = self._jupyter_curve
        if curve is None or any(a.context is context for a in self._authenticators):
            return
        local = f"replica {self.node_id} of kernel {self.kernel_id}"
        self._authenticators.append(start_thread_authenticator(context, local, curve))

    def close(self) -> None:
        # Their sockets would hold the contexts' term() up for good.
        for auth in self._authenticators:
            auth.stop()
        super().close()  # type: ignore[no-untyped-call]

    def init_kernel(self) -> None:
        _log_only_what_is_shown(self.log)
        super().init_kernel()  # type: ignore[no-untyped-call]
        if not self.kernel_id or not self.store:
            raise ConfigError("kernel-id/store", None, "both given")
        kernel: ReplicaKernel = self.kernel
        # IPython's banner picks its tip with the global random generator, on every
        # kernel_info_request: that would move the generator a cell draws from (and
        # which replicas keep in step) behind the user's back, on one replica only.
        assert kernel.shell is not None
        kernel.shell.enable_tip = False
        raft = RaftMemberThread(
            kernel_id=KernelId(self.kernel_id),
            node_id=NodeId(self.node_id),
            peers=parse_peers(self.raft_peers),
            data_dir=Path(self.data_dir) if self.data_dir else None,
            machine=kernel.machine(),
            settings=parse_raft_settings(self.raft_settings),
            join=self.join,
            recover=self.recover,
            curve=self._raft_curve,
        )
        kernel.attach(raft, open_store(self.store))
        if self.virtual_gpus:
            kernel.use_virtual_gpus()


def _log_only_what_is_shown(log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Raise the app's logger to the lowest level its handlers show.

    traitlets sets its application's logger to DEBUG and filters at the handlers
    (``log_level``): each of ipykernel's ``log.debug`` calls, five per cell and one with
    the whole message, then builds a record that no handler takes, on the executor's
    path. With ``--debug`` the handlers show DEBUG and nothing changes.
    """
    logger = log.logger if isinstance(log, logging.LoggerAdapter) else log
    levels = [h.level for h in logger.handlers]
    if levels:
        logger.setLevel(max(logger.level, min(levels)))


def wait_for_assignment() -> list[str]:
    """The argv a pre-started replica was assigned on its stdin, with its environment set.

    End of file (the agent went or closed its pool) ends the process with status 0;
    a line that does not decode, with status 2. Stdin is /dev/null afterwards, as a
    replica started cold has it, so the agent's pipe does not stay open.
    """
    import_startup_modules()
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)
    try:
        assignment = msgspec.json.decode(line, type=WarmAssignment)
    except msgspec.MsgspecError as exc:
        log.error("pre-started replica: bad assignment (%s)", exc)  # noqa: TRY400
        os._exit(2)
    # Read by Python at its start (PYTHONPATH ...), such variables come too late here;
    # the agent starts replicas that name them cold.
    os.environ.update(assignment.env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return assignment.argv


def show_assignment(argv: list[str]) -> None:
    """Title the process as the replica started cold with ``argv`` (``--kernel-id K
    --node-id N`` ...), where ``ps`` showed every pre-started one as ``--warm``.

    One string in place of the argv: ``ps`` and ``/proc/PID/cmdline`` read it whole
    (``setproctitle`` overwrites the argv and environment area on Linux).
    """
    import setproctitle  # only pre-started replicas need it

    # python -m nbos.kernel.replica, less its --warm (or its template's --template)
    started_as = sys.orig_argv[:-1]
    setproctitle.setproctitle(" ".join([*started_as, *argv]))


def import_ipykernel_debugger_without_debugpy() -> None:
    """Have ipykernel find debugpy missing, which keeps its debugger off.

    A replica does not offer the Jupyter debugger (nbos's kernelspec says
    ``debugger: false``: its breakpoints would stop one replica of three), yet ipykernel
    imports debugpy whenever it is installed: 8 MiB of every replica's memory. A user's
    ``import debugpy`` in a cell still works: only ipykernel's own import is turned away.
    """
    if "debugpy" in sys.modules:
        return
    sys.modules["debugpy"] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        importlib.import_module("ipykernel.debugger")
    finally:
        del sys.modules["debugpy"]


def main(argv: list[str] | None = None) -> Any:
    """Entry point of ``python -m nbos.kernel.replica``.

    nbos's log records go to the process's own stderr (its log file) through a
    duplicate of file descriptor 2 taken now: ipykernel later points fd 2 itself
    at a pipe that becomes cell output, where they do not belong.
    """
    keep_private()  # its Raft log and snapshots hold the kernel's cells
    nbos_log = logging.getLogger("nbos")
    nbos_log.setLevel(logging.INFO)
    nbos_log.propagate = False
    import_ipykernel_debugger_without_debugpy()
    if argv is None and sys.argv[1:] == [TEMPLATE_FLAG]:
        template_log = logging.StreamHandler(sys.stderr)  # fd 2: a fork's is its own log
        nbos_log.addHandler(template_log)
        serve_forks()  # returns in a forked process: a pre-started replica
        nbos_log.removeHandler(template_log)
        show_assignment([WARM_FLAG])
    _log_to_stderr(nbos_log)
    if argv is None and sys.argv[1:] in ([WARM_FLAG], [TEMPLATE_FLAG]):
        argv = wait_for_assignment()
        show_assignment(argv)
    try:
        ReplicaApp.launch_instance(argv=argv)
    except (RaftStateMissingError, StorageCorruptError) as exc:
        log.error("replica cannot restart from its disk: %s", exc)  # noqa: TRY400
        _exit_now(RAFT_STATE_GONE_STATUS)
    except NbosError as exc:
        log.error("replica cannot start: %s", exc)  # noqa: TRY400 - the message says it all
        _exit_now(2)
    except Exception:
        log.exception("replica cannot start")
        _exit_now(2)
    # The kernel answered shutdown_request only after its Raft member stopped and its log
    # was closed: nothing is left to save.
    log.info("replica shut down")
    _exit_now(0)


def _log_to_stderr(nbos_log: logging.Logger) -> None:
    handler = logging.StreamHandler(os.fdopen(os.dup(2), "w", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    nbos_log.addHandler(handler)


def _exit_now(status: int) -> NoReturn:
    # Interpreter teardown with ipykernel's and ZeroMQ's threads still about can abort
    # (SIGABRT), take seconds, or hang for good in ZeroMQ's context term (a socket whose
    # port would not bind is left open): skip it.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)
