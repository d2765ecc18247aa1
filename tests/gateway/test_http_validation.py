"""Bad input to the Kernel Gateway API that needs no kernel: a handler's bug is a JSON 500
and the server goes on; a WebSocket frame whose JSON is not UTF-8 is no message."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from tornado import httpclient, httpserver, netutil, web

from nbos.core.errors import DecodeError, HostUnreachableError
from nbos.gateway.auth import Authenticator
from nbos.gateway.http._handlers import ApiHandler, ApiRoot, api_errors, log_request
from nbos.gateway.http._wsproto import _frame_legacy, decode
from tests.gateway._http import call

pytestmark = pytest.mark.anyio


class _Buggy(ApiHandler):
    """A handler with a bug of the gateway's: an exception no HTTP or nbos error."""

    async def post(self) -> None:
        raise ValueError("deadline must not be NaN")


class _Unreachable(ApiHandler):
    """A request whose host did not answer in time (an agent paused or overloaded)."""

    async def post(self) -> None:
        with api_errors():
            raise HostUnreachableError("host-1", "no answer within 30 s")


@asynccontextmanager
async def _api(token: str) -> AsyncIterator[str]:
    """The API root and a buggy route on a free port, logged as the gateway logs; its URL."""
    settings = {"kernels": None, "authenticator": Authenticator(token)}
    app = web.Application(
        [
            (r"/api/?", ApiRoot, settings),
            (r"/api/buggy", _Buggy, settings),
            (r"/api/unreachable", _Unreachable, settings),
        ],
        log_function=log_request,
    )
    server = httpserver.HTTPServer(app)
    sockets = netutil.bind_sockets(0, "127.0.0.1")
    server.add_sockets(sockets)
    try:
        yield f"http://127.0.0.1:{sockets[0].getsockname()[1]}/api"
    finally:
        server.stop()
        await server.close_all_connections()


async def test_a_handler_that_raises_answers_a_json_500_with_a_log_line_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _api(token="t") as url:
        with caplog.at_level(logging.ERROR):
            code, answer = await call(f"{url}/buggy", "POST", {}, token="t")
        assert code == 500
        assert answer["reason"] == "Internal Server Error"
        assert "ValueError: deadline must not be NaN" in answer["message"]
        assert any(
            r.exc_info is not None and "/api/buggy" in r.getMessage() for r in caplog.records
        )
        assert (await call(url, token="t"))[0] == 200


@pytest.mark.parametrize(
    "json", [b'{"header": {"\xff": 1}}', b'{"header": {}, "channel": "\xed\xa0\x80"}']
)
def test_a_legacy_binary_frame_whose_json_is_not_utf8_is_no_message(json: bytes) -> None:
    # msgspec raises UnicodeDecodeError there, no DecodeError (msgspec#714): it closed the
    # client's WebSocket instead of dropping the frame.
    with pytest.raises(DecodeError, match="not a Jupyter message"):
        decode(_frame_legacy([json, b"buffer"]), "")


async def test_a_token_in_a_query_string_never_reaches_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Tornado logs every 4xx and 5xx with the request's URI: a right token on a wrong path,
    # a wrong token, a handler's bug. The gateway's own routes and tornado's 404 alike.
    async with _api(token="s3cret-token") as url:
        with caplog.at_level(logging.INFO):
            missing = await httpclient.AsyncHTTPClient().fetch(
                f"{url}/nope?token=s3cret-token", raise_error=False
            )
            assert missing.code == 404  # tornado's own page, not JSON
            assert (await call(f"{url}?token=wrong-guess"))[0] == 403
            assert (await call(f"{url}/buggy?token=s3cret-token", "POST", {}))[0] == 500
            assert (await call(f"{url}?token=s3cret-token"))[0] == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "s3cret-token" not in logged and "wrong-guess" not in logged, logged
    assert logged.count("token=[redacted]") >= 4, logged


async def test_a_host_that_did_not_answer_is_a_503_to_ask_again_after() -> None:
    async with _api(token="t") as url:
        response = await httpclient.AsyncHTTPClient().fetch(
            f"{url}/unreachable",
            method="POST",
            body=b"{}",
            headers={"Authorization": "token t"},
            raise_error=False,
        )
    assert response.code == 503, response.body
    assert int(response.headers["Retry-After"]) >= 1
    assert b"host-1" in response.body
