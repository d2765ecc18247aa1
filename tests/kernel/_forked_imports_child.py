"""What a pre-started replica still imports once assigned, after its template's imports.

Usage: ``python _forked_imports_child.py WORKDIR OUT``: imports what a replica template
imports before its first fork, initializes a one-replica kernel in WORKDIR as an
assigned replica does, starts and stops its Raft member, and writes the modules that
imported to OUT (one per line). The process then ends at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nbos.kernel.replica._app import ReplicaApp, import_ipykernel_debugger_without_debugpy
from nbos.kernel.replica._template import import_startup_modules
from nbos.transport.ports import free_loopback_ports


def main(workdir: Path, out: Path) -> None:
    import_ipykernel_debugger_without_debugpy()
    import_startup_modules()
    (port,) = free_loopback_ports(1)
    before = set(sys.modules)
    app = ReplicaApp.instance()
    app.initialize(
        [
            "--connection-file",
            str(workdir / "connection.json"),
            "--kernel-id",
            "k",
            "--node-id",
            "1",
            "--raft-peers",
            f'{{"1": "tcp://127.0.0.1:{port}"}}',
            "--store",
            str(workdir / "store"),
            "--HistoryManager.hist_file=:memory:",
        ]
    )
    raft = app.kernel._raft
    raft.start()
    raft.stop()
    out.write_text("".join(f"{name}\n" for name in sorted(set(sys.modules) - before)))
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
