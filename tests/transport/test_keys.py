"""``nbos keys`` and the key directory: files, modes, loading, and CURVE with them."""

from __future__ import annotations

import stat
from pathlib import Path

import anyio
import pytest

from nbos.cli.main import main
from nbos.core.errors import ConfigError
from nbos.core.ids import PeerId
from nbos.transport import ZmqTransport
from nbos.transport.keys import (
    KERNEL_PUBLIC_ENV,
    KERNEL_SECRET_ENV,
    KeyDirectory,
    generate_keys,
    kernel_keys_env,
    take_kernel_keys,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_command_makes_private_files_and_keeps_existing_pairs(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "h1", "h2"]) == 0
    files = sorted(p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file())
    assert files == [
        "gateway.key",
        "gateway.key_secret",
        "hosts/h1.key",
        "hosts/h1.key_secret",
        "hosts/h2.key",
        "hosts/h2.key_secret",
    ]
    assert all(_mode(keys / f) == 0o600 for f in files)
    assert _mode(keys) == _mode(keys / "hosts") == 0o700
    before = KeyDirectory(keys).host_public("h1")
    # A new host: only its pair is made; the others stay as they were.
    assert generate_keys(keys, ["h1", "h3"]) == [
        keys / "hosts" / "h3.key",
        keys / "hosts" / "h3.key_secret",
    ]
    assert KeyDirectory(keys).host_public("h1") == before
    assert KeyDirectory(keys).hosts() == ["h1", "h2", "h3"]


def test_loader_gives_each_side_the_keys_it_admits(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["h1", "h2"])
    keys = KeyDirectory(tmp_path)
    gateway = keys.gateway_curve()
    assert gateway.public_key == keys.gateway_public()
    assert gateway.admitted == {keys.host_public("h1"), keys.host_public("h2")}
    assert keys.host_curve("h1").admitted == {keys.gateway_public()}


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "a/b", "x" * 64])
def test_bad_host_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        generate_keys(tmp_path, [name])
    assert info.value.key == "host"


def test_missing_or_public_only_files_are_config_errors(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["h1"])
    (tmp_path / "hosts" / "h1.key_secret").unlink()
    with pytest.raises(ConfigError):
        KeyDirectory(tmp_path).host_curve("h1")
    (tmp_path / "gateway.key_secret").write_bytes((tmp_path / "gateway.key").read_bytes())
    with pytest.raises(ConfigError):
        KeyDirectory(tmp_path).gateway_curve()


@pytest.mark.anyio
async def test_a_host_key_reaches_the_gateway_and_a_foreign_key_does_not(tmp_path: Path) -> None:
    generate_keys(tmp_path / "ours", ["h1"])
    generate_keys(tmp_path / "theirs", ["h1"])
    ours, theirs = KeyDirectory(tmp_path / "ours"), KeyDirectory(tmp_path / "theirs")
    async with await ZmqTransport.open("gateway", curve=ours.gateway_curve()) as gateway:
        for directory, payload in ((theirs, b"foreign"), (ours, b"member")):
            async with await ZmqTransport.open(
                "h1/agent", curve=directory.host_curve("h1")
            ) as agent:
                agent.add_peer(PeerId("gateway"), gateway.address, server_key=ours.gateway_public())
                await agent.send(PeerId("gateway"), payload)
                if payload == b"member":
                    with anyio.fail_after(30):
                        assert await gateway.receive() == ("h1/agent", b"member")


def test_a_kernels_keys_are_taken_out_of_the_environment_that_hands_them_over() -> None:
    env = {**kernel_keys_env(), "OTHER": "1"}
    made = dict(env)
    keys = take_kernel_keys(env)
    assert env == {"OTHER": "1"}  # cells and their subprocesses do not see them
    assert keys is not None
    assert keys.secret_key == made[KERNEL_SECRET_ENV].encode()
    assert keys.admitted == {made[KERNEL_PUBLIC_ENV].encode()}
    assert take_kernel_keys(env) is None
    assert kernel_keys_env() != made


@pytest.mark.parametrize(
    "broken",
    [
        {KERNEL_SECRET_ENV: ""},  # one of the pair only
        {KERNEL_SECRET_ENV: "short"},
        {KERNEL_PUBLIC_ENV: kernel_keys_env()[KERNEL_PUBLIC_ENV]},  # another pair's
    ],
)
def test_a_broken_kernel_key_pair_is_a_config_error_that_does_not_show_it(
    broken: dict[str, str],
) -> None:
    env = kernel_keys_env() | broken
    secret = env[KERNEL_SECRET_ENV]
    with pytest.raises(ConfigError) as caught:
        take_kernel_keys(env)
    assert not secret or secret not in str(caught.value)
