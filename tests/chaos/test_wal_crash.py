"""kill -9 a process that appends to a WAL with fsync=always; nothing acknowledged may be lost.

The writer saves one entry per batch and prints each index once ``save`` has
returned (its acknowledgement); every so often it also snapshots and compacts,
so kills land in snapshot writes and file deletions too. After each kill the
directory is reopened: every acknowledged index must be in the log, intact, or
covered by a sound snapshot. Rounds and seed: NBOS_WAL_CRASH_ROUNDS, _SEED.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from nbos.raft.storage import DiskStorage

ROUNDS = int(os.environ.get("NBOS_WAL_CRASH_ROUNDS", "4"))
SEED = int(os.environ.get("NBOS_WAL_CRASH_SEED", "0"))
SEGMENT_BYTES = 8192

_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from nbos.core.wire.raft import ConfState, Entry, HardState, SnapshotMeta
    from nbos.raft.storage import DiskStorage

    directory, term, segment_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = DiskStorage.open(directory, fsync="always", segment_bytes=segment_bytes)
    s.save(HardState(term=term, vote=1, commit=s.hard_state.commit), [])
    print("ready", flush=True)
    i = s.last_index()
    while True:
        i += 1
        data = hashlib.sha256(b"%d" % i).digest() * 4
        s.save(HardState(term=term, vote=1, commit=i - 1), [Entry(term=term, index=i, data=data)])
        print(i, flush=True)
        if i % 150 == 0:
            at = i - 50
            meta = SnapshotMeta(index=at, term=s.term(at), conf=ConfState(voters=[1, 2, 3]))
            s.save_snapshot(meta, [b"image-upto-%d" % at] * 100)
            s.compact(at)
    """
)


def payload(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * 4


def run_and_kill(directory: Path, term: int, rng: random.Random) -> list[int]:
    """Start a writer, kill -9 it at a random moment; returns the indices it acknowledged."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory), str(term), str(SEGMENT_BYTES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    first_ack = threading.Event()  # start the clock once the writer is writing

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if len(lines) > 1:
                first_ack.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first_ack.wait(30), "writer never acknowledged an entry"
        time.sleep(rng.uniform(0.05, 0.5))
        assert proc.poll() is None, "writer died on its own"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    reader.join(timeout=30)
    assert lines[0] == "ready"
    return [int(x) for x in lines[1:]]


def check(directory: Path, acked: list[int]) -> None:
    s = DiskStorage.open(directory, segment_bytes=SEGMENT_BYTES)
    try:
        snap_index = s.snapshot.index if s.snapshot else 0
        if s.snapshot is not None:
            assert s.read_snapshot() == b"image-upto-%d" % snap_index * 100
        assert s.last_index() >= max(acked, default=0)
        for i in acked:
            if i > snap_index:
                (e,) = s.entries(i, i + 1)
                assert e.index == i and e.data == payload(i), f"entry {i} damaged"
    finally:
        s.close()


def test_acknowledged_entries_survive_kill_9(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    all_acked: list[int] = []
    for term in range(1, ROUNDS + 1):
        acked = run_and_kill(tmp_path, term, rng)
        all_acked.extend(acked)
        check(tmp_path, all_acked)
    assert len(all_acked) == len(set(all_acked))  # each restart continued after the last entry
