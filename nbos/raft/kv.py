"""A replicated key-value store: the reference :class:`~nbos.core.replicated_log.StateMachine`.

It shows the smallest real use of :func:`~nbos.raft.open_raft_log`, and it is the
workload of the Raft chaos tests and of ``bench/raft.py``, which run it as
separate processes::

    python -m nbos.raft.kv --node 1 --data-dir /tmp/n1 \\
        --member 1=tcp://127.0.0.1:7001 --member 2=tcp://127.0.0.1:7002 ...

A node process reads commands on stdin, one JSON object a line, and answers on
stdout (first ``{"ready": N}``): ``{"op": "put"|"append", "key": k, "value": v,
"client": c, "seq": n}``, ``{"op": "get", "key": k}`` (a linearizable read) and
``{"op": "status"}``. A request may carry an ``"id"``, echoed in its answer;
requests are served concurrently (256 at a time), so a client can keep many in
flight.
Answers: ``{"ok": true, "value": ...}`` (``put``, ``get``), ``{"ok": true, "size":
n}`` (``append``: the new length), ``{"ok": true, "leader", "applied", "data"}``
(``status``), or ``{"ok": false, "error": <error type>, "leader": <hint>}``.

:class:`NodeProcess` (with :func:`kv_node_argv`) runs such a process and keeps
requests to it in flight: the chaos tests and the benchmark drive nodes with it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import Process, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from nbos.core.config import RaftSettings
from nbos.core.errors import LogClosedError, NbosError
from nbos.core.ids import NodeId, PeerId
from nbos.raft._waiters import Outcome

if TYPE_CHECKING:
    from nbos.raft.driver import RaftReplicatedLog

log = logging.getLogger(__name__)


class KvCommand(msgspec.Struct, array_like=True):
    """``put`` sets a key; ``append`` appends to its value (a history a checker can read)."""

    op: str
    key: str
    value: str = ""


_decoder = msgspec.msgpack.Decoder(KvCommand)
_image = msgspec.msgpack.Decoder(dict[str, str])


class KeyValueStateMachine:
    """A dict of strings. ``apply`` answers the value after the command."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.applied: list[int] = []

    def apply(self, index: int, data: bytes) -> bytes:
        self.applied.append(index)
        try:
            command = _decoder.decode(data)
        except msgspec.MsgspecError:
            log.warning("entry %d is not a KV command", index)
            return b""
        if command.op == "put":
            self.data[command.key] = command.value
        elif command.op == "append":
            self.data[command.key] = self.data.get(command.key, "") + command.value
        return self.data.get(command.key, "").encode()

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(self.data)

    def restore(self, image: bytes) -> None:
        self.data = _image.decode(image)


def encode_command(op: str, key: str, value: str = "") -> bytes:
    return msgspec.msgpack.encode(KvCommand(op, key, value))


# --- the node process ------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True):
    """One line of a node process's stdin.

    ``id`` (any JSON value) is echoed in the answer: a client may keep many
    requests in flight on one node, which handles them concurrently and answers
    in completion order. ``client``/``seq`` name a write for exactly-once retries.
    """

    op: str
    key: str = ""
    value: str = ""
    client: str | None = None
    seq: int | None = None
    id: Any = None


_request_decoder = msgspec.json.Decoder(Request)
_json = msgspec.json.Encoder()
_answer_decoder = msgspec.json.Decoder(dict[str, Any])
_READ_CHUNK = 1 << 16
#: Requests served at once, by tasks started up front (a task started per request
#: cost 8-12% of the commits/s of bench/raft.py); more wait in line.
_WORKERS = 256
_WRITES = ("put", "append")
_WRITE_TIMEOUT_S = 2.0


def _peer(node: int) -> PeerId:
    return PeerId(f"kv/{node}")


async def _serve(args: argparse.Namespace) -> None:
    from nbos.raft.driver import open_raft_log
    from nbos.transport import open_transport

    members = dict(_parse_member(m) for m in args.member)
    settings = RaftSettings(tick_ms=args.tick_ms, fsync=args.fsync, snapshot_every=args.snapshot)
    machine = KeyValueStateMachine()
    async with await open_transport(_peer(args.node), members[args.node]) as transport:
        for node, address in members.items():
            if node != args.node:
                transport.add_peer(_peer(node), address)
        async with (
            open_raft_log(
                node_id=NodeId(args.node),
                members={NodeId(n): _peer(n) for n in members},
                transport=transport,
                data_dir=Path(args.data_dir),
                state_machine=machine,
                settings=settings,
            ) as raft,
            anyio.create_task_group() as tg,
        ):
            requests, taken = anyio.create_memory_object_stream[Request](math.inf)
            for _ in range(_WORKERS):
                tg.start_soon(_work, raft, machine, taken)
            _answer({"ready": args.node})
            async for line in _stdin_lines():
                request = _decode(line)
                if request is None:
                    continue
                if request.op in _WRITES:
                    # Proposed here and answered from the node loop as it applies: no
                    # worker wakes for it, nor resumes after it.
                    _propose(raft, request)
                else:
                    requests.send_nowait(request)
            tg.cancel_scope.cancel()  # stdin closed: the client is gone


async def _work(
    raft: RaftReplicatedLog,
    machine: KeyValueStateMachine,
    requests: MemoryObjectReceiveStream[Request],
) -> None:
    async for request in requests:
        _reply(request, await _handle(raft, machine, request))


async def _stdin_lines() -> AsyncIterator[bytes]:
    """Lines of stdin, read without a thread hop per line (many arrive at once under load)."""
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    pending = b""
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            continue
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                yield line


def _decode(line: bytes) -> Request | None:
    """The request on ``line``; a bad line is answered here (``None``)."""
    try:
        return _request_decoder.decode(line)
    except msgspec.DecodeError as exc:
        log.warning("bad request line %r: %s", line[:200], exc)
        _answer({"ok": False, "error": "DecodeError", "detail": str(exc)})
        return None


def _propose(raft: RaftReplicatedLog, request: Request) -> None:
    def answer(outcome: Outcome[bytes]) -> None:
        try:
            reply = _written(request.op, outcome.result())
        except NbosError as exc:
            reply = _refused(raft, exc)
        _reply(request, reply)

    data = encode_command(request.op, request.key, request.value)
    raft.propose_nowait(
        data, client_id=request.client, seq=request.seq, timeout=_WRITE_TIMEOUT_S, on_done=answer
    )


def _refused(raft: RaftReplicatedLog, exc: NbosError) -> dict[str, Any]:
    return {"ok": False, "error": type(exc).__name__, "leader": raft.leader_id}


def _written(op: str, result: bytes) -> dict[str, Any]:
    # An append answers only the new length: the value grows without bound.
    if op == "append":
        return {"ok": True, "size": len(result)}
    return {"ok": True, "value": result.decode()}


def _reply(request: Request, reply: dict[str, Any]) -> None:
    if request.id is not None:
        reply["id"] = request.id
    _answer(reply)


async def _handle(
    raft: RaftReplicatedLog, machine: KeyValueStateMachine, request: Request
) -> dict[str, Any]:
    op = request.op
    try:
        if op == "get":
            await raft.read_index(timeout=2.0)
            return {"ok": True, "value": machine.data.get(request.key)}
        if op == "status":
            return {
                "ok": True,
                "leader": raft.leader_id,
                "applied": raft.applied_index,
                "data": machine.data,
            }
    except NbosError as exc:
        return _refused(raft, exc)
    log.warning("unknown op %r", op)
    return {"ok": False, "error": "UnknownOp", "detail": f"unknown op {op!r}"}


def _answer(reply: dict[str, Any]) -> None:
    # One write per answer, straight to the pipe: answers of concurrent requests
    # never interleave and nothing waits in a userspace buffer.
    data = _json.encode(reply) + b"\n"
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(1, view) :]
        except BlockingIOError:  # a terminal shares its file with the non-blocking stdin
            select.select([], [1], [])


# --- a client of node processes ------------------------------------------------------


def kv_node_argv(
    node: int,
    members: Mapping[int, str],
    data_dir: Path,
    *,
    fsync: str = "always",
    tick_ms: int = 10,
    snapshot: int = 1000,
) -> list[str]:
    """The command line of a ``python -m nbos.raft.kv`` node process."""
    argv = [sys.executable, "-m", "nbos.raft.kv", "--node", str(node), "--data-dir", str(data_dir)]
    argv += ["--fsync", fsync, "--tick-ms", str(tick_ms), "--snapshot", str(snapshot)]
    for member, address in sorted(members.items()):
        argv += ["--member", f"{member}={address}"]
    return argv


class NodeProcess:
    """One child process speaking the JSON-lines protocol above, with requests pipelined.

    ``request`` never raises for the node's sake: a node that is dead, stopped or
    slow answers ``{"ok": False, "error": "Unavailable" | "Timeout"}``, so a
    client treats every failure alike (and, for a write, as of unknown outcome).
    The process can be started again after it died (same argv, same data). The
    caller kills only what it started: ``kill``/``pause``/``resume`` signal this
    process's own PID.
    """

    def __init__(self, argv: Sequence[str], stderr_path: Path | None = None) -> None:
        self.argv = list(argv)
        self.stderr_path = stderr_path
        self.process: Process | None = None
        # request id -> (the incarnation it went to, its answer)
        self._pending: dict[int, tuple[Process, Outcome[dict[str, Any]]]] = {}
        self._next_id = 0

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, task_group: TaskGroup, timeout: float = 20.0) -> None:
        """Spawn the process and wait for its first line (``{"ready": ...}``)."""
        stderr = None if self.stderr_path is None else self.stderr_path.open("ab")
        try:
            self.process = await anyio.open_process(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
        finally:
            if stderr is not None:
                stderr.close()
        ready: Outcome[dict[str, Any]] = Outcome()
        task_group.start_soon(self._read_answers, self.process, ready)
        with anyio.fail_after(timeout):
            await ready.wait()

    async def request(self, request: Mapping[str, Any], timeout: float = 3.0) -> dict[str, Any]:
        process = self.process
        if process is None or process.returncode is not None or process.stdin is None:
            return {"ok": False, "error": "Unavailable"}
        self._next_id += 1
        rid = self._next_id
        outcome: Outcome[dict[str, Any]] = Outcome()
        self._pending[rid] = (process, outcome)
        try:
            with anyio.move_on_after(timeout):
                await process.stdin.send(_json.encode({**request, "id": rid}) + b"\n")
                return await outcome.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return {"ok": False, "error": "Unavailable"}
        finally:
            self._pending.pop(rid, None)
        return {"ok": False, "error": "Timeout"}

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    async def stop(self) -> None:
        """Kill the process (if it runs) and reap it."""
        process = self.process
        if process is None:
            return
        self.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()

    def _signal(self, signum: int) -> None:
        if self.alive:
            assert self.process is not None
            # The event loop's child watcher may have reaped it a moment ago.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signum)

    async def _read_answers(self, process: Process, ready: Outcome[dict[str, Any]]) -> None:
        assert process.stdout is not None
        pending = b""
        try:
            async for chunk in process.stdout:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._dispatch(process, line, ready)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            ready.fail(LogClosedError(f"node process {process.pid} ended before it was ready"))
            # Requests to this incarnation get no answer now, even if a new one runs.
            for sent_to, outcome in self._pending.values():
                if sent_to is process:
                    outcome.set({"ok": False, "error": "Unavailable"})

    def _dispatch(self, process: Process, line: bytes, ready: Outcome[dict[str, Any]]) -> None:
        try:
            answer = _answer_decoder.decode(line)
        except msgspec.DecodeError:
            log.warning("node process wrote a bad line %r", line[:200])
            return
        if "ready" in answer:
            ready.set(answer)
            return
        waiting = self._pending.get(answer.get("id"))  # type: ignore[arg-type]
        if waiting is not None and waiting[0] is process:
            waiting[1].set(answer)


def _parse_member(text: str) -> tuple[int, str]:
    node, _, address = text.partition("=")
    return int(node), address


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nbos.raft.kv")
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--member", action="append", required=True, help="ID=ADDRESS")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--tick-ms", type=int, default=10)
    parser.add_argument("--fsync", default="batch", choices=["always", "batch", "never"])
    parser.add_argument("--snapshot", type=int, default=1000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    anyio.run(_serve, args)


if __name__ == "__main__":
    main()
