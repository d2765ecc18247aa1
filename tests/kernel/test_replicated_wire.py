"""The front's message codec and the replica's argument parsing, without processes."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from ipykernel.kernelapp import IPKernelApp
from jupyter_client.session import Session

from nbos.core.config import RaftSettings
from nbos.core.errors import AuthenticationError, ConfigError, DecodeError, KernelError
from nbos.core.ids import NodeId
from nbos.kernel.front._requests import Channel, UnknownRequestError, reply_type, screen
from nbos.kernel.front._wire import Signer, Unparsed
from nbos.kernel.protocol import cell_request
from nbos.kernel.replica import DEVICES_KEY, EXEC_INDEX_KEY, parse_peers
from nbos.kernel.replica._app import _log_only_what_is_shown, parse_raft_settings

KEY = "k" * 64


def client_frames(key: str = KEY, **content: object) -> list[bytes]:
    session = Session(key=key.encode())
    msg = session.msg("execute_request", {"code": "1", **content})
    frames: list[bytes] = session.serialize(msg, [b"client-id"])
    return frames


def test_a_client_message_is_verified_decoded_and_resigned_for_another_key() -> None:
    front, replica = Signer({"key": KEY}), Signer({"key": "r" * 64})
    idents, msg = front.parse(client_frames(extra=[1, 2]))
    assert idents == [b"client-id"]
    assert msg["msg_type"] == "execute_request" and msg["content"]["extra"] == [1, 2]
    assert isinstance(msg["header"]["date"], str)  # relayed as it came, not re-interpreted
    # The replica's own Session accepts what the front re-signed with the replica's key.
    relayed = replica.frames(msg)
    check = Session(key=b"r" * 64)
    _, rest = check.feed_identities(relayed)
    assert check.deserialize(rest)["content"]["code"] == "1"


def published_frames(key: str, msg_type: str, content: dict[str, object]) -> list[bytes]:
    session = Session(key=key.encode())
    frames: list[bytes] = session.serialize(session.msg(msg_type, content), [b"kernel.x.topic"])
    return frames


def test_published_output_is_relayed_unparsed_its_bytes_as_they_came_and_resigned() -> None:
    replica, front = Signer({"key": "r" * 64}), Signer({"key": KEY})
    frames = published_frames("r" * 64, "stream", {"name": "stdout", "text": "x\u00e9\n"})
    _, msg = replica.parse(frames, content=False)
    assert isinstance(msg["content"], Unparsed) and msg["content"].data is frames[-1]
    out = front.frames(msg, [b"kernel.x.stream"], session_id="front-session")
    assert out[-1] is frames[-1]  # the content's own bytes, not a copy
    # A client with the front's key verifies and reads it.
    check = Session(key=KEY.encode())
    _, rest = check.feed_identities(out)
    relayed = check.deserialize(rest)
    assert relayed["content"] == {"name": "stdout", "text": "x\u00e9\n"}
    assert relayed["header"]["session"] == "front-session"


def test_unparsed_content_is_still_verified_and_a_status_is_decoded() -> None:
    replica = Signer({"key": "r" * 64})
    frames = published_frames("r" * 64, "stream", {"name": "stdout", "text": "x"})
    frames[-1] = frames[-1].replace(b'"x"', b'"y"')
    with pytest.raises(AuthenticationError):
        replica.parse(frames, content=False)
    status = published_frames("r" * 64, "status", {"execution_state": "idle"})
    _, msg = replica.parse(status, content=False)
    assert msg["content"] == {"execution_state": "idle"}


def test_the_front_session_id_replaces_the_replicas() -> None:
    signer = Signer({"key": KEY})
    _, msg = signer.parse(client_frames())
    out = signer.frames(msg, session_id="front-session")
    _, again = Signer({"key": KEY}).parse(out)
    assert again["header"]["session"] == "front-session"


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        (client_frames(key="w" * 64), AuthenticationError),
        (client_frames(key=""), AuthenticationError),
        ([b"no delimiter"], DecodeError),
        ([b"<IDS|MSG>", b"sig", b"{}"], DecodeError),
    ],
    ids=["wrong key", "unsigned", "no delimiter", "too few frames"],
)
def test_bad_messages_are_refused_with_typed_errors(
    frames: list[bytes], error: type[Exception]
) -> None:
    with pytest.raises(error):
        Signer({"key": KEY}).parse(frames)


def test_a_replayed_message_is_refused() -> None:
    signer, frames = Signer({"key": KEY}), client_frames()
    signer.parse(frames)
    with pytest.raises(AuthenticationError, match="replayed"):
        signer.parse(frames)


def test_well_signed_frames_that_are_not_a_jupyter_message_are_refused() -> None:
    session = Session(key=KEY.encode())
    parts = [b'{"msg_id": "x", "msg_type": "t"}', b"{}", b"{}", b"[1]"]  # content not an object
    frames = [b"<IDS|MSG>", session.sign(parts), *parts]
    with pytest.raises(DecodeError, match="content"):
        Signer({"key": KEY}).parse(frames)
    not_json = [b"{", b"{}", b"{}", b"{}"]
    with pytest.raises(DecodeError, match="JSON"):
        Signer({"key": KEY}).parse([b"<IDS|MSG>", session.sign(not_json), *not_json])


def test_cell_requests_need_a_positive_index_and_int_devices() -> None:
    assert cell_request({EXEC_INDEX_KEY: 3, DEVICES_KEY: [0, 1]}) == (3, (0, 1))
    assert cell_request({EXEC_INDEX_KEY: 1}) == (1, ())
    for bad in (None, {}, {EXEC_INDEX_KEY: 0}, {EXEC_INDEX_KEY: True}, {EXEC_INDEX_KEY: "1"}):
        with pytest.raises(KernelError):
            cell_request(bad)
    with pytest.raises(KernelError):
        cell_request({EXEC_INDEX_KEY: 2, DEVICES_KEY: ["0"]})


def test_replica_arguments_parse_or_raise_config_errors() -> None:
    peers = parse_peers('{"1": "tcp://a:1", "2": "tcp://b:1"}')
    assert peers == {NodeId(1): "tcp://a:1", NodeId(2): "tcp://b:1"}
    # an older gateway's [raft, forwarder] pairs: a replica it launched restarts in place
    assert parse_peers('{"1": ["tcp://a:1", "tcp://a:2"]}') == {NodeId(1): "tcp://a:1"}
    assert parse_raft_settings('{"tick_ms": 5}') == RaftSettings(tick_ms=5)
    for text in ("{bad", "{}", '{"x": "a"}', '{"1": ["only one"]}', '{"1": 7}'):
        with pytest.raises(ConfigError):
            parse_peers(text)
    with pytest.raises(ConfigError):
        parse_raft_settings('{"tick_ms": "fast"}')


def request(msg_type: str, content: dict[str, object], **header: object) -> dict[str, Any]:
    return {"header": {"msg_id": "m", "msg_type": msg_type, **header}, "content": content}


@pytest.mark.parametrize(
    ("channel", "msg", "verdict"),
    [
        ("shell", request("execute_request", {"code": "1", "silent": False}), None),
        ("shell", request("complete_request", {"code": "x", "cursor_pos": None}), None),
        ("shell", request("comm_msg", {"comm_id": "c", "data": {"k": 1}}), None),
        ("control", request("interrupt_request", {}), None),
        ("control", request("debug_request", {"command": "anything"}), None),
        ("shell", request("bogus_request", {}), UnknownRequestError),
        ("shell", request("nbos_digest_request", {}), UnknownRequestError),
        ("shell", request("interrupt_request", {}), UnknownRequestError),
        ("control", request("execute_request", {"code": "1"}), UnknownRequestError),
        ("control", request("comm_close", {"comm_id": "c"}), UnknownRequestError),
        ("control", request("create_subshell_request", {}), UnknownRequestError),
        ("shell", request("execute_request", {}), DecodeError),
        ("shell", request("execute_request", {"code": 5}), DecodeError),
        ("shell", request("execute_request", {"code": "1", "silent": 1}), DecodeError),
        ("shell", request("execute_request", {"code": "1"}, subshell_id="s"), DecodeError),
        ("shell", request("inspect_request", {"code": "x"}), DecodeError),
        ("shell", request("history_request", {"hist_access_type": "tail"}), DecodeError),
        ("shell", request("comm_open", {"comm_id": "c"}), DecodeError),
        ("control", request("shutdown_request", {"restart": "yes"}), DecodeError),
    ],
)
def test_client_requests_are_screened_by_channel_type_and_content(
    channel: Channel, msg: dict[str, Any], verdict: type[Exception] | None
) -> None:
    if verdict is None:
        screen(channel, msg)
        return
    with pytest.raises(verdict) as caught:
        screen(channel, msg)
    assert type(caught.value) is verdict  # an unknown type is not a bad content, and back


def test_replies_are_named_after_their_request() -> None:
    assert reply_type("kernel_info_request") == "kernel_info_reply"
    assert reply_type("comm_msg") is None


@pytest.mark.parametrize("level", [logging.WARNING, logging.DEBUG])
def test_a_replica_app_builds_no_debug_records_its_handlers_would_drop(level: int) -> None:
    # traitlets sets its app's logger to DEBUG and filters at the handler (log_level).
    app = IPKernelApp(log_level=level)
    assert app.log.isEnabledFor(logging.DEBUG)
    _log_only_what_is_shown(app.log)
    # Unless the app shows DEBUG (--debug), ipykernel's log.debug calls are no-ops.
    assert app.log.isEnabledFor(logging.DEBUG) == (level == logging.DEBUG)
    assert app.log.isEnabledFor(logging.WARNING)
