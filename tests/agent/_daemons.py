"""``nbos agent`` processes and a gateway endpoint process that tests drive by hand."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import attrs
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from nbos.agent import process_start_ticks
from nbos.agent._replicas import ReplicaRecord
from nbos.core.ids import PeerId
from nbos.core.wire import AnyMessage, decode, encode
from nbos.core.wire.agent import AgentHello, AgentWelcome

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60.0
_RESEND_S = 2.0
M = TypeVar("M")
#: Wraps an argv to run it elsewhere (a network namespace); identity by default.
Where = Callable[[Sequence[str]], list[str]]


def here(argv: Sequence[str]) -> list[str]:
    return list(argv)


@attrs.define
class FakeGateway:
    """The gateway's side, by hand, through a relay process (see ``_gateway_relay``)."""

    process: anyio.abc.Process
    address: str
    log: Path
    received: list[tuple[PeerId, AnyMessage]] = attrs.Factory(list)
    changed: anyio.Event = attrs.Factory(anyio.Event)
    ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))

    async def _command(self, **command: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send((json.dumps(command) + "\n").encode())

    async def add_peer(self, peer: str, address: str, key: str = "") -> None:
        await self._command(op="add_peer", peer=peer, address=address, key=key)

    async def send(self, peer: str, message: AnyMessage | bytes) -> None:
        data = message if isinstance(message, bytes) else encode(message)
        await self._command(op="send", peer=peer, data=base64.b64encode(data).decode())

    async def wait_for(
        self, kind: type[M], where: Callable[[M], bool] = lambda _: True, after: int = 0
    ) -> M:
        """The first message of ``kind`` (from index ``after`` on) that ``where`` accepts."""
        with anyio.fail_after(DEADLINE):
            while True:
                for _, message in self.received[after:]:
                    if isinstance(message, kind) and where(message):
                        return message
                self.changed = anyio.Event()
                await self.changed.wait()

    async def call(self, peer: str, make: Callable[[int], AnyMessage]) -> AnyMessage:
        """Send ``make(request_id)`` (resent now and then) and return the reply with that id."""
        rid = next(self.ids)
        request = make(rid)

        def answers(m: Any) -> bool:
            return getattr(m, "request_id", None) == rid and m is not request

        with anyio.fail_after(DEADLINE):
            while True:
                await self.send(peer, request)
                with anyio.move_on_after(_RESEND_S):
                    return await self.wait_for(msgspec.Struct, answers)  # type: ignore[type-abstract]

    async def welcome(self, host: str, after: int = 0) -> AgentHello:
        """Wait for ``host``'s hello, connect to it and welcome it."""
        hello = await self.wait_for(AgentHello, lambda h: h.host_id == host, after)
        await self.add_peer(f"{host}/agent", hello.address, hello.public_key)
        await self.send(f"{host}/agent", AgentWelcome(host, hello.incarnation))
        return hello

    async def _read(self) -> None:
        assert self.process.stdout is not None
        lines = BufferedByteReceiveStream(self.process.stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", 1 << 26)
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return
            record = json.loads(line)
            self.received.append(
                (PeerId(record["sender"]), decode(base64.b64decode(record["data"])))
            )
            self.changed.set()


@asynccontextmanager
async def fake_gateway(
    log_dir: Path, bind: str = "tcp://127.0.0.1:0", keys: Path | None = None, where: Where = here
) -> AsyncIterator[FakeGateway]:
    log = log_dir / "gateway-relay.log"
    argv = [sys.executable, "-m", "tests.agent._gateway_relay", bind]
    with log.open("ab") as stderr:
        process = await anyio.open_process(
            where([*argv, *([str(keys)] if keys else [])]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        assert process.stdout is not None
        with anyio.fail_after(DEADLINE):
            first = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
        gateway = FakeGateway(process, json.loads(first)["address"], log)
        async with anyio.create_task_group() as tg:
            tg.start_soon(gateway._read)
            yield gateway
            tg.cancel_scope.cancel()
    finally:
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()


@attrs.define
class AgentProcess:
    """One ``python -m nbos agent``; :meth:`kill` ends it, :func:`end_replicas` its replicas."""

    host: str
    process: subprocess.Popen[bytes]
    log: Path
    state_dir: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.process.wait(timeout)


def start_agent(
    host: str,
    gateway: str,
    tmp: Path,
    *,
    address: str = "127.0.0.1:0",
    keys: Path | None = None,
    extra: Sequence[str] = (),
    where: Where = here,
    config: Path | None = None,
    env: Mapping[str, str] | None = None,
    gpus: int = 2,
) -> AgentProcess:
    """``nbos agent`` for ``host`` with ``gpus`` virtual GPUs (``config``: its settings
    file, with ``[agent]``; ``env``: more environment, ``NBOS_*`` settings over those of
    ``config``)."""
    state_dir = tmp / f"state-{host}"
    log = tmp / f"agent-{host}.log"
    settings = ["--config", str(config)] if config is not None else []
    argv = [sys.executable, "-m", "nbos", "--log-level", "INFO", *settings, "agent"]
    argv += ["--host", host]
    argv += ["--address", address, "--gateway", gateway, "--state-dir", str(state_dir)]
    argv += ["--gpus", str(gpus), "--heartbeat", "0.2", *extra]
    if keys is not None:
        argv += ["--keys", str(keys)]
    with log.open("ab") as out:
        process = subprocess.Popen(
            where(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )
    return AgentProcess(host, process, log, state_dir)


def recorded(state_dir: Path) -> list[ReplicaRecord]:
    """The replica records an agent left in ``state_dir``."""
    return [
        msgspec.json.decode(p.read_bytes(), type=ReplicaRecord)
        for p in sorted((state_dir / "replicas").glob("*.json"))
    ]


def end_replicas(state_dir: Path) -> None:
    """SIGKILL the process groups of recorded replicas that are still the processes recorded."""
    for record in recorded(state_dir):
        if not record.ended and process_start_ticks(record.pid) == record.start_ticks:
            with suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
