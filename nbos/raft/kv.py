"""A replicated key-value store: the reference :class:`~nbos.core.replicated_log.StateMachine`.

It shows the smallest real use of :func:`~nbos.raft.open_raft_log`, and it is the
workload of the Raft chaos tests and of ``bench/raft.py``, which run it as
separate processes::

    python -m nbos.raft.kv --node 1 --data-dir /tmp/n1 \\
        --member 1=tcp://127.0.0.1:7001 --member 2=tcp://127.0.0.1:7002 ...

A node process reads commands on stdin, one JSON object a line, and answers on
stdout: ``{"op": "put", "key": k, "value": v, "client": c, "seq": n}``,
``{"op": "get", "key": k}`` (a linearizable read) and ``{"op": "status"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from nbos.core.config import RaftSettings
from nbos.core.errors import NbosError
from nbos.core.ids import NodeId, PeerId

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


def _peer(node: int) -> PeerId:
    return PeerId(f"kv/{node}")


async def _serve(args: argparse.Namespace) -> None:
    from nbos.raft.driver import open_raft_log
    from nbos.transport import ZmqTransport

    members = dict(_parse_member(m) for m in args.member)
    settings = RaftSettings(tick_ms=args.tick_ms, fsync=args.fsync, snapshot_every=args.snapshot)
    machine = KeyValueStateMachine()
    async with await ZmqTransport.open(_peer(args.node), members[args.node]) as transport:
        for node, address in members.items():
            if node != args.node:
                transport.add_peer(_peer(node), address)
        async with open_raft_log(
            node_id=NodeId(args.node),
            members={NodeId(n): _peer(n) for n in members},
            transport=transport,
            data_dir=Path(args.data_dir),
            state_machine=machine,
            settings=settings,
        ) as raft:
            _answer({"ready": args.node})
            stdin = anyio.wrap_file(sys.stdin)
            async for line in stdin:
                _answer(await _handle(raft, machine, json.loads(line)))


async def _handle(
    raft: Any, machine: KeyValueStateMachine, request: dict[str, Any]
) -> dict[str, Any]:
    op = request.get("op")
    try:
        if op in ("put", "append"):
            data = encode_command(op, request["key"], request["value"])
            result = await raft.propose(
                data, client_id=request.get("client"), seq=request.get("seq"), timeout=2.0
            )
            return {"ok": True, "value": result.decode()}
        if op == "get":
            await raft.read_index(timeout=2.0)
            return {"ok": True, "value": machine.data.get(request["key"])}
        if op == "status":
            return {
                "ok": True,
                "leader": raft.leader_id,
                "applied": raft.applied_index,
                "data": machine.data,
            }
    except NbosError as exc:
        return {"ok": False, "error": type(exc).__name__, "leader": raft.leader_id}
    return {"ok": False, "error": f"unknown op {op!r}"}


def _answer(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


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
