"""The replica's Jupyter session: replies go out as soon as they may, and say what
preceded them.

Every message a replica sends passes through its ``Session``. This one does two things
for the front, which relays the replica's messages to clients:

* **Each reply counts the request's IOPub messages.** Under
  :data:`~nbos.kernel.protocol.IOPUB_COUNT_KEY` in its metadata, a reply carries how
  many IOPub messages (other than ``status``) the replica published with the request as
  their parent before it. The front relays those over another socket than the reply, so
  they may come later; once it has relayed that many, nothing of the request is still on
  its way, and its ``idle`` can go out. The replica's own ``idle``, one hop of
  ipykernel's IOPub thread later, still follows: it ends the front's wait should an
  IOPub message be lost, or a handler fail without a reply.
* **JSON through msgspec.** The kernel's thread packs every message it sends, and
  ``json.dumps`` costs it about 13 µs a message where msgspec takes 1; the bytes are
  the same JSON but for whitespace, and non-finite floats go out as ``null`` (as with
  jupyter_client's own orjson packer). What msgspec cannot encode (keys that are not
  strings or numbers, say) goes through jupyter_client's packer, fallbacks included.
* **A reply leaves without waiting for the kernel's loop.** ipykernel's shell stream
  queues what it sends until the loop turns again, or until the kernel flushes the
  stream after publishing its ``idle``: a cell's reply waited for that publish. Here the
  stream is flushed as a reply is sent; an ``execute_reply`` just before the request's
  ``idle`` (:meth:`ReplicaSession.release`), once ipykernel's last flush of the cell's
  ``stdout`` and ``stderr`` has published what they still held, so that it counts too:
  as with ipykernel, everything published before the ``idle`` comes before the front's.

A message counts when it is handed to ipykernel's IOPub thread, which sends in that
order over one socket: the front can only have relayed as many once the counted ones
reached it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import msgspec
import zmq
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session, extract_header, json_packer, json_unpacker
from tornado.ioloop import IOLoop
from traitlets import Callable
from zmq.eventloop.zmqstream import ZMQStream

from nbos.kernel.protocol import IOPUB_COUNT_KEY

#: How many requests' counts are remembered: a reply pops its count, so only requests
#: never answered (or output published after the reply) stay.
_REMEMBERED = 1024
#: What the kernel sends on other channels than IOPub (besides replies), and ``status``,
#: which the front does not relay.
_NOT_COUNTED = frozenset({"status", "input_request"})
#: The reply held until its request's idle: the one of a cell, whose output may still be
#: flushed after it.
_HELD = "execute_reply"


_encoder = msgspec.json.Encoder(enc_hook=json_default)
_decoder = msgspec.json.Decoder()


def pack_json(obj: Any) -> bytes:
    """``obj`` as JSON, as jupyter_client's packer makes it (see the module doc)."""
    try:
        return _encoder.encode(obj)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        return json_packer(obj)


def unpack_json(data: bytes | str) -> Any:
    """What jupyter_client's unpacker makes of ``data``, JSON decoded by msgspec."""
    try:
        return _decoder.decode(data)
    except ValueError:  # NaN literals, invalid UTF-8: jupyter_client takes those
        return json_unpacker(data)


class ReplicaSession(Session):
    """``Session`` of a replica kernel (see the module doc)."""

    # Defaults only: a configured ``packer`` still replaces them.
    pack = Callable(pack_json)
    unpack = Callable(unpack_json)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._published: OrderedDict[str, int] = OrderedDict()
        self._held: dict[str, tuple[Any, dict[str, Any], Any, Any]] = {}

    def send(  # noqa: PLR0917 (jupyter_client's signature, positional callers included)
        self,
        stream: Any,
        msg_or_type: dict[str, Any] | str,
        content: dict[str, Any] | None = None,
        parent: dict[str, Any] | None = None,
        ident: bytes | list[bytes] | None = None,
        buffers: list[Any] | None = None,
        track: bool = False,
        header: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        if isinstance(msg_or_type, dict):
            msg_type = msg_or_type["header"]["msg_type"]
            parent = msg_or_type.get("parent_header")
        else:
            msg_type = msg_or_type
        parent_id = extract_header(parent).get("msg_id") if parent else None
        if stream is not None and isinstance(parent_id, str):
            if not msg_type.endswith("_reply"):
                if msg_type not in _NOT_COUNTED:
                    self._count(parent_id)
            elif not isinstance(msg_or_type, dict):  # a message built already keeps its own
                msg = self.msg(msg_type, content, parent, header, metadata)
                if msg_type == _HELD and _own_stream(stream):
                    self._held[parent_id] = (stream, msg, ident, buffers)
                else:
                    self._send_reply(parent_id, stream, msg, ident, buffers)
                return msg
        return super().send(
            stream, msg_or_type, content, parent, ident, buffers, track, header, metadata
        )

    def release(self, parent_id: str) -> None:
        """Send the reply held for request ``parent_id``, if any (on the kernel's thread,
        as the request's idle is about to be published)."""
        held = self._held.pop(parent_id, None)
        if held is not None:
            self._send_reply(parent_id, *held)

    def _send_reply(
        self, parent_id: str, stream: Any, msg: dict[str, Any], ident: Any, buffers: Any
    ) -> None:
        with self._lock:
            count = self._published.pop(parent_id, 0)
        msg["metadata"] = {**msg["metadata"], IOPUB_COUNT_KEY: count}
        super().send(stream, msg, ident=ident, buffers=buffers)
        if _own_stream(stream):
            # Through the stream, not its socket: a send on the socket can take the edge
            # of the file descriptor that tells the stream a request came in meanwhile,
            # which it would then never read. A flush re-checks.
            stream.flush(zmq.POLLOUT)

    def _count(self, parent_id: str) -> None:
        with self._lock:
            self._published[parent_id] = self._published.pop(parent_id, 0) + 1
            while len(self._published) > _REMEMBERED:
                self._published.popitem(last=False)


def _own_stream(stream: Any) -> bool:
    """Whether ``stream`` is an open ``ZMQStream`` of the calling thread's loop."""
    return (
        isinstance(stream, ZMQStream)
        and not stream.closed()
        and stream.io_loop is IOLoop.current(instance=False)
    )
