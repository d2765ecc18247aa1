"""``python -m nbos.kernel.replica --template``: the process an agent's pre-started replicas
are forked from (``[agent] fork_replicas``, ``docs/deploy.md``).

It imports everything a replica needs once, then forks each pre-started replica on its
agent's request, as Android's zygote or :mod:`multiprocessing`'s forkserver do: the
forks share the interpreter's and the libraries' pages with it (copy on write), where
processes started one by one each hold their own copy. As Python's ``gc`` documentation
advises, the collector is off in the template from its first import (objects it frees
would leave holes in the shared pages, which a fork's objects fill, copying them) and
``gc.freeze()`` before the first fork keeps a fork's collections from writing to (and so
copying) every imported object; a fork turns it back on for its own objects.

The agent talks to it over a ``SOCK_SEQPACKET`` socket on its stdin. A request
(:data:`~nbos.core.wire.agent.FORK_REQUEST`) carries the new process's stdin and log
descriptors; the answer is a :class:`~nbos.core.wire.agent.TemplateForked` with the
process's pidfd (so the agent holds that very process, whatever happens to its PID), and
a :class:`~nbos.core.wire.agent.TemplateExited` follows once the template reaped it (and
killed what was left of its process group, as the agent's backend does for processes
it started). At end of file (its agent went away) the template exits; the processes it
forked go on in sessions of their own, as replicas outlive their agent.

It must fork with one thread, no event loop, no ZeroMQ context and no open socket but
its agent's: it checks the first, and the rest it never makes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import select
import signal
import socket

import msgspec

from nbos.core.wire.agent import FORK_REQUEST, TemplateExited, TemplateForked

log = logging.getLogger(__name__)

# What ipykernel and IPython import only while a kernel starts (to start sooner
# themselves; found with ``python -X importtime``): a pre-started replica has the time
# before its assignment, a template before its first fork. One that is not installed is
# ipykernel's concern, not ours.
_STARTUP_IMPORTS = (
    "anyio._backends._asyncio",  # the Raft member's event loop (about 13 ms)
    "anyio._core._sockets",
    "anyio._core._streams",
    "argcomplete",
    "faulthandler",
    "IPython.core.completerlib",
    "IPython.core.debugger",
    "IPython.core.logger",
    "IPython.core.oinspect",
    "IPython.extensions.storemagic",
    "psutil",
    "sqlite3",
    "tornado.platform.asyncio",
)
# A fork request's descriptors: the new process's stdin and its log.
_REQUEST_FDS = 2
#: The template's exit status when it finds a thread besides its own: a fork would copy
#: that thread's locks but not the thread.
THREADED_STATUS = 3


def import_startup_modules() -> None:
    for name in _STARTUP_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def serve_forks() -> None:
    """Fork pre-started replicas on the requests arriving on stdin, until end of file.

    Returns only in a forked process, with its stdin, stdout and stderr its own and in a
    session of its own: it goes on as a pre-started replica. The template itself ends
    the process (status 0 at end of file).
    """
    import_startup_modules()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        log.error("replica template: %d threads, where a fork needs 1; exiting", threads)
        os._exit(THREADED_STATUS)
    control = socket.socket(fileno=os.dup(0))
    _stdin_from_devnull()
    gc.freeze()
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([control.fileno(), *children], [], [])
        for pidfd in readable:
            if pidfd in children:
                _reap(control, children.pop(pidfd), pidfd)
        if control.fileno() in readable and _fork_one(control, children):
            return


def _fork_one(control: socket.socket, children: dict[int, int]) -> bool:
    """Serve one request; ``True`` in the forked process."""
    message, fds, _, _ = socket.recv_fds(control, len(FORK_REQUEST), _REQUEST_FDS)
    if not message:
        os._exit(0)  # the agent went away (however: its end of the socket closed)
    if message != FORK_REQUEST or len(fds) != _REQUEST_FDS:
        log.error("replica template: bad request %r with %d descriptors", message, len(fds))
        for fd in fds:
            os.close(fd)
        return False
    stdin, output = fds
    pid = os.fork()
    if pid == 0:
        _become_replica(control, children, stdin, output)
        return True
    os.close(stdin)
    os.close(output)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = pid
    socket.send_fds(control, [msgspec.json.encode(TemplateForked(pid))], [pidfd])
    return False


def _become_replica(
    control: socket.socket, children: dict[int, int], stdin: int, output: int
) -> None:
    os.setsid()  # its own session and process group, as the agent starts processes
    control.close()
    for pidfd in children:
        os.close(pidfd)
    children.clear()
    gc.enable()  # its own objects; the template's stay frozen
    os.dup2(stdin, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(stdin)
    os.close(output)


def _reap(control: socket.socket, pid: int, pidfd: int) -> None:
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    # Right after its leader was reaped the group id names no newer process: what is
    # left of the group (processes its cells started) goes with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    report = TemplateExited(pid, os.waitstatus_to_exitcode(status))
    with contextlib.suppress(OSError):  # the agent is gone: end of file comes next
        control.send(msgspec.json.encode(report))


def _stdin_from_devnull() -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
