"""Programs the backend tests start, and ways to look at them from outside."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

#: Every test process carries this variable, so leftovers can be found in /proc.
MARKER_ENV = "NBOS_TEST_MARKER"

SLEEP = "import time; time.sleep(60)"
EXIT_3 = "import sys; sys.exit(3)"
WRITE_ENV = """
import os, sys
open(sys.argv[1], 'w').write(os.environ['FOO'] + ' ' + os.environ['NBOS_HOST_ID'])
"""
# Bumps a counter in the file argv[1] every 10 ms (atomically, so a reader never sees half).
TICKER = """
import os, sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1] + '.tmp', 'w') as f:
        f.write(str(n))
    os.replace(sys.argv[1] + '.tmp', sys.argv[1])
    time.sleep(0.01)
"""
# Handles (or ignores) SIGTERM, then says it is ready by creating argv[1].
TERM_EXITS_0 = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""
TERM_IGNORED = TERM_EXITS_0.replace("lambda *_: sys.exit(0)", "signal.SIG_IGN")
# Starts a grandchild, then says it is ready: a signal must reach both.
FAMILY = """
import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
pathlib.Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(60)
"""

# Starts a grandchild, says so, and exits: the grandchild must not outlive it.
LEAVES_A_CHILD = """
import pathlib, subprocess, sys
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
pathlib.Path(sys.argv[1]).write_text(str(child.pid))
"""


def python(code: str, *args: str | Path) -> list[str]:
    """An argv running ``code`` with this interpreter (mounted into containers at the same path)."""
    return [sys.executable, "-c", code, *map(str, args)]


def marked_pids(marker: str) -> list[int]:
    """Live (not zombie) processes on this machine whose environment carries ``marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


async def holds_within(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``predicate`` (a look at processes or files, which offer no event) until it holds."""
    with anyio.move_on_after(timeout):
        while True:
            if predicate():
                return True
            await anyio.sleep(0.02)
    return predicate()


async def wait_until_no_marked(marker: str, timeout: float = 5.0) -> Sequence[int]:
    """Poll until no process carries ``marker``; returns the survivors (empty on success)."""
    await holds_within(lambda: not marked_pids(marker), timeout)
    return marked_pids(marker)


async def wait_for_file(path: Path, timeout: float = 15.0) -> str:
    """The content of ``path`` once it exists."""
    assert await holds_within(path.exists, timeout), f"{path} never appeared"
    return await anyio.Path(path).read_text()


def read_counter(path: Path) -> int:
    return int(path.read_text() or 0)
