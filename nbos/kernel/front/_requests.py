"""Which client requests the front serves on which channel, and what their content must be.

A signed client message can still be one the kernel must not act on: a type it does
not know (Jupyter's rule: log it and go on, as ipykernel does), an internal ``nbos_``
type only the front itself may send, or a known request whose content the replica
would choke on (ipykernel logs such a request and sends no reply). The front screens
every request here before anything of it reaches a replica or the kernel's log, so
that no client can leave a channel waiting for a reply that never comes.

Content is checked with msgspec against the fields the replica reads; fields not
named here are let through, as the Jupyter protocol allows.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from nbos.core.errors import DecodeError

Channel = Literal["shell", "control"]


class UnknownRequestError(DecodeError):
    """A message type the kernel does not serve on that channel: logged and ignored."""


class _Empty(msgspec.Struct):
    pass


class _Execute(msgspec.Struct):
    code: str
    silent: bool = False
    store_history: bool = True
    user_expressions: dict[str, str] = {}
    allow_stdin: bool = False
    stop_on_error: bool = True


class _Code(msgspec.Struct):
    code: str


class _Cursor(msgspec.Struct):
    code: str
    cursor_pos: int | None  # None: the end of the code, as ipykernel reads it


class _Inspect(msgspec.Struct):
    code: str
    cursor_pos: int | None
    detail_level: int = 0
    omit_sections: list[str] = []


class _History(msgspec.Struct, forbid_unknown_fields=True):
    # ipykernel passes the content as keyword arguments: an extra field is a TypeError.
    hist_access_type: str
    output: bool
    raw: bool
    session: int | None = None
    start: int | None = None
    stop: int | None = None
    n: int | None = None
    pattern: str | None = None
    unique: bool = False


class _CommInfo(msgspec.Struct):
    target_name: str | None = None


class _CommOpen(msgspec.Struct):
    comm_id: str
    target_name: str
    data: dict[str, Any] = {}


class _Comm(msgspec.Struct):
    comm_id: str
    data: dict[str, Any] = {}


class _Shutdown(msgspec.Struct):
    restart: bool = False


# Requests any replica answers alike, on either channel (ipykernel takes shell
# requests on control too).
_QUERIES: dict[str, type[msgspec.Struct]] = {
    "kernel_info_request": _Empty,
    "connect_request": _Empty,
    "comm_info_request": _CommInfo,
    "complete_request": _Cursor,
    "inspect_request": _Inspect,
    "history_request": _History,
    "is_complete_request": _Code,
}
_SERVED: dict[Channel, dict[str, type[msgspec.Struct]]] = {
    "shell": {
        **_QUERIES,
        "execute_request": _Execute,
        "comm_open": _CommOpen,
        "comm_msg": _Comm,
        "comm_close": _Comm,
    },
    # Cells and comm messages go through the shell only: they are ordered there, and
    # only the shell path puts them through the log. Subshells are not offered.
    "control": {
        **_QUERIES,
        "shutdown_request": _Shutdown,
        "interrupt_request": _Empty,
        "debug_request": _Empty,
        "usage_request": _Empty,
    },
}


def screen(channel: Channel, msg: dict[str, Any]) -> None:
    """Check a client's request on ``channel`` before the front acts on it.

    Raises :class:`UnknownRequestError` for a type not served there (an ``nbos_``
    type included) and :class:`DecodeError` for a served type with bad content.
    """
    msg_type = msg["header"]["msg_type"]
    schema = _SERVED[channel].get(msg_type)
    if schema is None:
        raise UnknownRequestError(f"unknown message type {msg_type!r} on {channel}")
    if msg["header"].get("subshell_id") is not None:
        raise DecodeError(f"{msg_type} names a subshell; this kernel has none")
    try:
        msgspec.convert(msg["content"], schema)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"bad {msg_type} content: {exc}") from exc


def reply_type(msg_type: str) -> str | None:
    """The type of the reply to ``msg_type``; ``None`` for a message without one."""
    stem, _, kind = msg_type.rpartition("_")
    return f"{stem}_reply" if kind == "request" and stem else None
