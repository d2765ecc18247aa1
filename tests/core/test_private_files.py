"""What nbos writes is its owner's only, and tokens stay out of its logs."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import nbos
from nbos.core.private_files import open_private, private_dir, redact_tokens, write_private

pytestmark = pytest.mark.anyio

SECRET = "hunter2-in-a-cell"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_dirs_and_files_are_their_owners_even_if_they_existed(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    assert private_dir(loose / "a" / "b") == loose / "a" / "b"
    assert _mode(loose / "a" / "b") == 0o700
    private_dir(loose)
    assert _mode(loose) == 0o700
    log = loose / "x.log"
    log.write_bytes(b"before\n")
    log.chmod(0o644)
    with open_private(log) as f:
        f.write(b"after\n")
    assert _mode(log) == 0o600 and log.read_bytes() == b"before\nafter\n"
    write_private(loose / "c.json", b"{}")
    assert _mode(loose / "c.json") == 0o600 and (loose / "c.json").read_bytes() == b"{}"
    assert not (loose / "c.json.tmp").exists()


_TOKEN = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~%", min_size=1)


@given(token=_TOKEN)
def test_a_token_in_a_query_string_or_header_is_redacted(token: str) -> None:
    line = "404 GET /api/kernels/nope?x=1&token={}&y=2 (127.0.0.1) 0.52ms"
    assert redact_tokens(line.format(token)) == line.format("[redacted]")
    assert redact_tokens(f"GET /api?token={token}") == "GET /api?token=[redacted]"
    header = f"Authorization: token {token}"
    assert redact_tokens(header) == "Authorization: token [redacted]"


async def test_a_kernels_files_hold_its_cells_and_key_and_only_their_owner_reads_them(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    async with nbos.LocalCluster(hosts=3, durable=True, run_dir=run) as cluster:
        kernel = await cluster.start_kernel()
        result = await kernel.execute(f"password = {SECRET!r}")
        assert result.status == "ok", result.reply
        # A large value: its buffer goes to the object store as a blob.
        result = await kernel.execute(f"blob = bytearray({SECRET!r}.encode() * 100_000)")
        assert result.status == "ok", result.reply
        await kernel.digests()  # every replica applied it: it is in every Raft log
        holders = [p for p in run.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        keys = list(run.rglob("connection.json"))
        logs = list(run.rglob("*.log"))
        # Read while the replicas run: a file they create later is theirs to make private.
        modes = {p: _mode(p) for p in [*holders, *keys, *logs]}
        dirs = {p.parent: _mode(p.parent) for p in [*holders, *keys]}
    assert len({p for p in holders if "wal-" in p.name}) >= 3, holders
    assert any("store" in p.relative_to(run).parts for p in holders), holders
    assert len(keys) == 3
    assert {p: m for p, m in modes.items() if m & 0o077} == {}
    assert {p: m for p, m in dirs.items() if m & 0o077} == {}
