"""JupyterHub as an identity provider (:class:`nbos.gateway.auth.HubUsers`), against a real
Hub (one for the module, users alice and bob and the admin ``admin``), and against a
server that answers as no Hub does (errors, garbage, too much, nothing)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from nbos.core.config import Settings
from nbos.core.errors import ConfigError, IdentityProviderError, UnauthorizedError
from nbos.core.identity import User
from nbos.gateway.auth import Authenticator, HubUsers
from tests._servers._process import free_port, serve_or_skip
from tests._servers.jupyterhub import JupyterHub, start_jupyterhub

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    yield from serve_or_skip(
        lambda: start_jupyterhub(tmp_path_factory.mktemp("hub")), "a JupyterHub"
    )


async def test_each_token_is_its_users_and_a_hub_admin_is_an_admin(hub: JupyterHub) -> None:
    alice, bob, admin = (hub.new_token(name)[0] for name in ("alice", "bob", "admin"))
    users = HubUsers(hub.api_url, default_quota=2)
    assert await users.authenticate(alice) == User(name="alice", role="user", quota=2)
    assert await users.authenticate(bob) == User(name="bob", role="user", quota=2)
    assert await users.authenticate(admin) == User(name="admin", role="admin", quota=2)
    # A second token of a user is that user too.
    assert await users.authenticate(hub.new_token("bob")[0]) == User(name="bob", quota=2)
    for unknown in ("garbage", alice[:-1], alice + "x", "x" * 10_000):
        assert await users.authenticate(unknown) is None
    # What no header may carry (a ?token= decodes to any text) is no token, not an error.
    for unsendable in (f"{alice}\r\nX-Injected: 1", f"{alice}\n", "tökén", "a\0b"):
        assert await users.authenticate(unsendable) is None
    # A service's token is no user's (its name could be any user's).
    assert await users.authenticate(hub.admin_token) is None


async def test_the_authenticator_asks_the_hub_after_the_operator_token(hub: JupyterHub) -> None:
    settings = Settings.load(
        env={
            "NBOS_GATEWAY__AUTH_TOKEN": "operator-secret",
            "NBOS_AUTH__JUPYTERHUB_API_URL": hub.api_url,
            "NBOS_AUTH__JUPYTERHUB_CACHE_S": "0",
            "NBOS_AUTH__DEFAULT_QUOTA": "1",
        }
    )
    authenticator = Authenticator.of(settings)
    assert authenticator.has_users
    token, _ = hub.new_token("alice")
    assert await authenticator.authenticate(token) == User(name="alice", quota=1)
    assert (await authenticator.authenticate("operator-secret")).name == "operator"
    with pytest.raises(UnauthorizedError):
        await authenticator.authenticate("garbage")


async def test_a_revoked_token_is_refused_once_its_cached_answer_expires(hub: JupyterHub) -> None:
    token, token_id = hub.new_token("alice")
    kept, brief, uncached = (HubUsers(hub.api_url, cache_s=s) for s in (3600, 1.0, 0))
    alice = User(name="alice")
    for users in (kept, brief, uncached):
        assert await users.authenticate(token) == alice
    asked = time.monotonic()
    hub.revoke("alice", token_id)

    assert await uncached.authenticate(token) is None
    assert await kept.authenticate(token) == alice  # the cached answer, not the Hub's
    await anyio.sleep(max(0.0, asked + 1.5 - time.monotonic()))
    assert await brief.authenticate(token) is None
    # What the Hub refused is not kept: a new token of the user works at once.
    fresh, _ = hub.new_token("alice")
    assert await uncached.authenticate(fresh) == alice


@pytest.fixture
def own_hub(tmp_path: Path) -> Iterator[JupyterHub]:
    """A Hub of the test's own, which it may stop."""
    yield from serve_or_skip(lambda: start_jupyterhub(tmp_path / "hub"), "a JupyterHub")


async def test_a_stopped_hub_is_an_error_not_an_unknown_token(
    own_hub: JupyterHub, caplog: pytest.LogCaptureFixture
) -> None:
    hub = own_hub
    alice, _ = hub.new_token("alice")
    bob, _ = hub.new_token("bob")
    users = HubUsers(hub.api_url, cache_s=3600, timeout_s=5)
    assert await users.authenticate(alice) == User(name="alice")
    hub.stop()
    assert hub.process.returncode is not None
    with caplog.at_level(logging.WARNING, "nbos.gateway.auth"):
        with pytest.raises(IdentityProviderError, match="did not answer"):
            await users.authenticate(bob)
        with pytest.raises(IdentityProviderError):
            await users.authenticate("garbage")
    assert "JupyterHub at " in caplog.text
    assert bob not in caplog.text  # tokens are never logged
    # A user already answered for stays known for the cache time.
    assert await users.authenticate(alice) == User(name="alice")


_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
_CLOSED = "closed the connection before a whole answer"
_NOT_A_MODEL = "answered what is not a user model"
#: Answers no Hub gives, each an error (never a user, never "unknown"), and what it is.
_GARBAGE = {
    "5xx": (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n", "answered 500"),
    "bad gateway": (b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 2\r\n\r\nno", "answered 502"),
    "redirect": (
        b"HTTP/1.1 302 Found\r\nLocation: /hub/login\r\nContent-Length: 0\r\n\r\n",
        "answered 302",
    ),
    "not JSON": (_OK + b"Content-Length: 9\r\n\r\nnot JSON!", _NOT_A_MODEL),
    "a list": (_OK + b"Content-Length: 2\r\n\r\n[]", _NOT_A_MODEL),
    "no name": (_OK + b'Content-Length: 15\r\n\r\n{"admin": true}', _NOT_A_MODEL),
    "a number name": (_OK + b'Content-Length: 11\r\n\r\n{"name": 5}', _NOT_A_MODEL),
    # Refused unread: read, it would be "not a user model".
    "too long": (_OK + b"Content-Length: %d\r\n\r\n" % (1 << 20) + b" " * (1 << 20), _CLOSED),
    "too long, chunked": (
        _OK + b"Transfer-Encoding: chunked\r\n\r\n" + 2 * (b"10000\r\n" + b" " * 0x10000 + b"\r\n")
        + b"0\r\n\r\n",
        _CLOSED,
    ),
    "cut short": (_OK + b'Content-Length: 100\r\n\r\n{"name": "al', _CLOSED),
    "closed": (b"", _CLOSED),
    "nothing": (None, "did not answer (HTTPTimeoutError"),
}  # fmt: skip


async def _answer_with(answer: bytes | None, stream: anyio.abc.SocketStream) -> None:
    async with stream:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive()
        if answer is None:
            await anyio.sleep_forever()
        await stream.send(answer)


async def _serve(answer: bytes | None, task_status: anyio.abc.TaskStatus[int]) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener:
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(lambda stream: _answer_with(answer, stream))


@pytest.mark.parametrize("what", list(_GARBAGE))
async def test_an_answer_no_hub_gives_is_an_error(
    what: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with anyio.create_task_group() as not_a_hub:
        answer, error = _GARBAGE[what]
        port = await not_a_hub.start(_serve, answer)
        users = HubUsers(f"http://127.0.0.1:{port}/hub/api", timeout_s=2)
        with (
            caplog.at_level(logging.WARNING, "nbos.gateway.auth"),
            anyio.fail_after(60),
            pytest.raises(IdentityProviderError, match=re.escape(error)),
        ):
            await users.authenticate("a-token")
        not_a_hub.cancel_scope.cancel()
    assert f"JupyterHub at http://127.0.0.1:{port}/hub/api/user" in caplog.text
    assert "a-token" not in caplog.text


async def test_no_hub_listening_is_an_error() -> None:
    users = HubUsers(f"http://127.0.0.1:{free_port()}/hub/api", timeout_s=5)
    with pytest.raises(IdentityProviderError, match="did not answer"):
        await users.authenticate("a-token")


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "ftp://hub/hub/api"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "127.0.0.1:8081"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "http:///hub/api"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "http://h/api?x=1"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "http://h:99999/hub/api"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "http://h:port/hub/api"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_API_URL": "http://[::1/hub/api"}, "auth.jupyterhub_api_url"),
        ({"NBOS_AUTH__JUPYTERHUB_CACHE_S": "5"}, "auth.jupyterhub_cache_s"),
        ({"NBOS_AUTH__JUPYTERHUB_CACHE_S": "soon"}, "auth.jupyterhub_cache_s"),
        ({"NBOS_AUTH__JUPYTERHUB_KEY": "x"}, "auth.jupyterhub_key"),
    ]
    + [
        (
            {
                "NBOS_AUTH__JUPYTERHUB_API_URL": "http://h/hub/api",
                "NBOS_AUTH__JUPYTERHUB_CACHE_S": v,
            },
            "auth.jupyterhub_cache_s",
        )
        for v in ("-1", "nan", "inf")
    ],
)
def test_bad_hub_settings_are_refused(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Authenticator.of(Settings.load(env=env))
    assert refused.value.key == key


def test_good_hub_settings_make_a_hub_provider() -> None:
    for url in ("http://127.0.0.1:8081/hub/api", "https://hub.example.org/hub/api/"):
        settings = Settings.load(env={"NBOS_AUTH__JUPYTERHUB_API_URL": url})
        (provider,) = Authenticator.of(settings).providers
        assert isinstance(provider, HubUsers)
        assert provider.user_url == url.rstrip("/") + "/user"
        assert provider.cache_s == 60.0
    assert Authenticator.of(Settings.load(env={})).providers == ()
