"""The users file, the authenticator and the operator token's file, on real files."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from nbos.core.config import GatewaySettings, Settings
from nbos.core.errors import ConfigError, UnauthorizedError
from nbos.core.identity import User, hash_token, new_token
from nbos.gateway.auth import (
    OPERATOR,
    Authenticator,
    UsersFile,
    client_token,
    remove_token_file,
    token_path,
    users_file_entry,
    write_token_file,
)
from nbos.gateway.control_api import (
    ControlError,
    ControlReply,
    ControlRequest,
    KernelList,
    ListKernels,
    call,
    serve_control,
)
from nbos.transport.ports import free_loopback_ports

pytestmark = pytest.mark.anyio


def _users(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "users.toml"
    path.write_text(text)
    return path


async def test_a_users_file_knows_its_users_by_their_tokens_and_keeps_no_token(
    tmp_path: Path,
) -> None:
    alice, carol = new_token(), new_token()
    path = _users(
        tmp_path, users_file_entry("alice", alice) + users_file_entry("carol", carol, "admin", 2)
    )
    users = UsersFile(path, default_quota=1)
    assert await users.authenticate(alice) == User(name="alice", role="user", quota=1)
    assert await users.authenticate(carol) == User(name="carol", role="admin", quota=2)
    assert await users.authenticate(alice + "x") is None
    assert alice not in path.read_text() and hash_token(alice) in path.read_text()


async def test_a_changed_users_file_is_read_again_and_a_bad_change_keeps_the_users_before(
    tmp_path: Path,
) -> None:
    alice, bob = new_token(), new_token()
    path = _users(tmp_path, users_file_entry("alice", alice))
    users = UsersFile(path)
    path.write_text(users_file_entry("bob", bob))
    os.utime(path, ns=(0, 10**9))  # a distinct stamp, however fast the rewrite
    assert await users.authenticate(alice) is None
    assert (await users.authenticate(bob)) == User(name="bob")
    path.write_text("[users.bob]\ntoken_hash = 'sha256:nothex'\n")
    os.utime(path, ns=(0, 2 * 10**9))
    assert (await users.authenticate(bob)) == User(name="bob")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[users.a]\ntoken_hash = 'sha256:00'\n", "users.a.token_hash"),
        (f"[users.a]\ntoken_hash = '{hash_token('t')}'\nrole = 'root'\n", "users.a.role"),
        (f"[users.a]\ntoken_hash = '{hash_token('t')}'\nquota = -1\n", "users.a.quota"),
        (f"[users.a]\ntoken_hash = '{hash_token('t')}'\ncolour = 1\n", "users.a.colour"),
        (f"[users.operator]\ntoken_hash = '{hash_token('t')}'\n", "users.operator"),
        (
            f"[users.a]\ntoken_hash = '{hash_token('t')}'\n"
            f"[users.b]\ntoken_hash = '{hash_token('t')}'\n",
            "users.b.token_hash",
        ),
        ("[users.a\n", ""),
    ],
)
def test_a_bad_users_file_stops_the_start_naming_the_key(
    tmp_path: Path, text: str, key: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        UsersFile(_users(tmp_path, text))
    assert key in str(raised.value)


def test_a_missing_users_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"auth\.users_file"):
        UsersFile(tmp_path / "none.toml")


async def test_the_operator_token_comes_first_then_the_providers_and_nothing_else(
    tmp_path: Path,
) -> None:
    alice = new_token()
    auth = Authenticator("op", [UsersFile(_users(tmp_path, users_file_entry("alice", alice)))])
    assert await auth.authenticate("op") == OPERATOR and OPERATOR.is_admin
    assert (await auth.authenticate(alice)).name == "alice"
    for token in ("", "OP", alice[:-1]):
        with pytest.raises(UnauthorizedError):
            await auth.authenticate(token)


def test_the_token_file_is_private_and_found_by_the_gateways_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("NBOS_TOKEN", raising=False)
    path = write_token_file("127.0.0.1:7070", "secret")
    assert path == token_path("tcp://10.0.0.1:7070")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert client_token("127.0.0.1:7070") == "secret"
    assert client_token("127.0.0.1:7070", "given") == "given"
    monkeypatch.setenv("NBOS_TOKEN", "from-env")
    assert client_token("127.0.0.1:7070") == "from-env"
    remove_token_file(path, "another gateway's")
    assert path.exists()
    remove_token_file(path, "secret")
    assert not path.exists()
    monkeypatch.delenv("NBOS_TOKEN")
    assert client_token("127.0.0.1:7070") == ""


def test_a_durable_gateway_keeps_its_operator_token_and_a_set_one_wins(tmp_path: Path) -> None:
    kept = tmp_path / "gateway" / "operator.token"
    first = Authenticator.of(Settings(), kept).operator_token
    assert Authenticator.of(Settings(), kept).operator_token == first
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert Authenticator.of(Settings()).operator_token != first  # no data dir: a fresh one
    chosen = Settings(gateway=GatewaySettings(auth_token="chosen"))
    assert Authenticator.of(chosen, kept).operator_token == "chosen"


def test_the_quotas_the_scheduler_reads_follow_the_file(tmp_path: Path) -> None:
    path = _users(tmp_path, users_file_entry("alice", "a", quota=1))
    quotas = UsersFile(path, default_quota=5).quotas
    assert dict(quotas) == {"alice": 1}
    path.write_text(users_file_entry("alice", "a", quota=3) + users_file_entry("bob", "b"))
    os.utime(path, ns=(0, 10**9))
    time.sleep(1.1)  # the view looks at the file again at most every second
    assert dict(quotas) == {"alice": 3, "bob": 5}


async def test_a_client_that_read_a_stale_token_file_asks_again_with_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asked before the gateway (re)wrote its token file is refused once, reads
    the file again and is answered: it raced a gateway's start or restart."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("NBOS_TOKEN", raising=False)
    (port,) = free_loopback_ports(1)
    address = f"127.0.0.1:{port}"
    write_token_file(address, "stale")
    authenticator = Authenticator("fresh")
    seen: list[str] = []

    async def authenticate(token: str) -> User:
        seen.append(token)
        write_token_file(address, "fresh")  # the gateway's start got here meanwhile
        return await authenticator.authenticate(token)

    async def handle(user: User, request: ControlRequest) -> ControlReply:
        return KernelList([])

    socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    socket.bind(f"tcp://{address}")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_control, socket, handle, authenticate)
            assert await call(address, ListKernels(), timeout=30) == KernelList([])
            given = await call(address, ListKernels(), timeout=30, token="wrong")
            tg.cancel_scope.cancel()
    finally:
        socket.close(0)
    assert seen == ["stale", "fresh", "wrong"]
    assert isinstance(given, ControlError) and given.kind == "unauthorized"  # given: no retry
