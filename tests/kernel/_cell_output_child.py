"""Cells' fds 1 and 2 (``CellOutput``) on ipykernel's own ``OutStream`` and IOPub thread.

Usage: ``python _cell_output_child.py``. Runs cells that write on fd 1, that write
nothing, and one that forks a child which writes after the cell ended; prints one JSON
object: the ``stream`` messages IOPub published (parent msg_id, text), how much the
process's open fds grew over 100 quiet cells, how often the output thread woke for
them, and how many pipes it still watches at the end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

from _iopub_pair import iopub_pair
from ipykernel.iostream import OutStream

from nbos.kernel.replica import _output

iopub, session, sub = iopub_pair()
report_to = sys.stdout
sys.stdout = OutStream(session, iopub, "stdout", watchfd=False)
sys.stderr = OutStream(session, iopub, "stderr", watchfd=False)


def cell(msg_id: str, body: Callable[[], object]) -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.set_parent({"msg_id": msg_id})  # type: ignore[attr-defined]
    with _output.CellOutput():
        body()


def wakes(thread_name: str) -> int:
    thread = next(t for t in threading.enumerate() if t.name == thread_name)
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        line = next(x for x in status if x.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def published(seconds: float) -> list[tuple[str, str]]:
    found = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if sub.poll(100):
            _, frames = session.feed_identities(sub.recv_multipart())
            msg = session.deserialize(frames)
            if msg["msg_type"] == "stream":
                found.append((msg["parent_header"]["msg_id"], msg["content"]["text"]))
    return found


def fork_a_late_writer() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(1.0)
        os.write(1, b"late from the child\n")
        os._exit(0)
    return pid


time.sleep(0.3)  # the subscription reaches the publisher
cell("first", lambda: os.write(1, b"on fd 1\n"))
fds = len(os.listdir("/proc/self/fd"))
woke = wakes("nbos-cell-output")
for i in range(100):
    cell(f"quiet-{i}", lambda: None)
report = {
    "woke": wakes("nbos-cell-output") - woke,
    "fds_grew_by": len(os.listdir("/proc/self/fd")) - fds,
}
child = 0


def start_child() -> None:
    global child  # noqa: PLW0603
    child = fork_a_late_writer()


cell("parent", start_child)
cell("later", lambda: os.write(1, b"later cell\n"))
os.waitpid(child, 0)
report["streams"] = published(3.0)
assert _output._reader is not None
report["watched_at_end"] = len(_output._reader._pumps)
report_to.write(json.dumps(report) + "\n")
report_to.flush()
