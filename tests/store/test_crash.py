"""A writer killed with SIGKILL in the middle of a large put leaves no blob behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from nbos.store import LocalObjectStore
from tests._servers.redis_server import RedisServer

WRITER = Path(__file__).with_name("_crash_writer.py")


def writer_killed_mid_put(kind: str, where: str) -> None:
    """Run the writer until it reports a write under way, then SIGKILL it."""
    args = [sys.executable, str(WRITER), kind, where]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 30.0)
            line = child.stdout.readline() if ready else b""
            assert line == b"writing\n", f"writer did not start: {line!r}, {_stderr(child)}"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL


def _stderr(child: subprocess.Popen[bytes]) -> str:
    if child.poll() is None or child.stderr is None:
        return "writer still running"
    return child.stderr.read().decode(errors="replace")[-2000:]


def blob_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.parent.name != "tmp"]


def test_local_writer_killed_mid_put_leaves_only_a_part_file_which_reopen_removes(
    tmp_path: Path,
) -> None:
    writer_killed_mid_put("local", str(tmp_path))

    parts = list((tmp_path / "tmp").iterdir())
    assert len(parts) == 1 and parts[0].suffix == ".part"
    assert parts[0].stat().st_size > 0  # killed while writing, not before
    assert blob_files(tmp_path) == []

    LocalObjectStore(tmp_path)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert blob_files(tmp_path) == []


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.mark.redis
def test_redis_writer_killed_mid_put_leaves_only_a_part_hash_which_expires(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    writer_killed_mid_put("redis", redis_server.url)

    keys = [k.decode() for k in redis_client.scan_iter(match="*")]
    assert len(keys) == 1 and keys[0].startswith("nbos:part:"), keys
    assert redis_client.hlen(keys[0]) >= 4  # killed while writing, not before
    assert 0 < redis_client.pttl(keys[0]) <= 1000

    deadline = time.monotonic() + 5.0
    while redis_client.exists(keys[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(redis_client.scan_iter(match="*")) == []
