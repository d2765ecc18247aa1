"""The kernel host process: one replicated kernel on an embedded local cluster, for Jupyter.

Jupyter launches ``python -m nbos.jupyter.host -f CONNECTION_FILE`` through the
``nbos`` kernelspec and its provisioner. The process starts a
:class:`~nbos.cluster.LocalCluster`, starts one kernel on it, and writes the
kernel front's connection info, atomically, to :func:`front_info_path` beside
``CONNECTION_FILE``; the provisioner hands it to the kernel manager, which
rewrites the connection file with it. It lives as
long as the kernel does: it exits 0 once a client shut the kernel down, and 3
when fewer than a quorum of replicas are alive, so a process poll tells Jupyter
whether the kernel lives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from nbos.cluster import Kernel, LocalCluster
from nbos.core.config import Settings

log = logging.getLogger(__name__)

#: Exit status of a host whose kernel lost its quorum of replicas.
QUORUM_LOST = 3
_POLL_S = 0.5


def front_info_path(connection_file: Path) -> Path:
    """Where the host writes the front's connection info for ``connection_file``."""
    return connection_file.with_name(connection_file.name + ".front")


def write_connection_file(path: Path, info: dict[str, Any], kernel: Kernel) -> None:
    """Replace ``path`` atomically with the front's connection info."""
    data = dict(info)
    if isinstance(data.get("key"), bytes):
        data["key"] = data["key"].decode()
    data["nbos"] = {"kernel_id": kernel.kernel_id, "replicas": len(kernel.replicas)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def has_quorum(kernel: Kernel) -> bool:
    replicas = kernel.replicas
    return sum(r.alive for r in replicas) * 2 > len(replicas)


async def serve(connection_file: Path, settings: Settings, gpus: int = 0) -> int:
    """Run one kernel (cells ask for ``gpus`` GPUs by default) until it ends; the exit status."""
    async with LocalCluster(hosts=settings.cluster.hosts, settings=settings) as cluster:
        kernel = await cluster.start_kernel(gpus=gpus)
        info_file = front_info_path(connection_file)
        write_connection_file(info_file, dict(kernel.connection_info), kernel)
        log.info("kernel %s serving at %s", kernel.kernel_id, connection_file)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, kernel)
            status = await _until_closed_or_quorum_lost(kernel)
            tg.cancel_scope.cancel()
        return status


async def _until_closed_or_quorum_lost(kernel: Kernel) -> int:
    while not kernel.closed.is_set():
        # Replicas exiting because a client asked for shutdown are not a lost quorum.
        if not has_quorum(kernel) and not kernel.front.shutdown_requested.is_set():
            log.error("kernel %s lost its quorum: %s", kernel.kernel_id, kernel.replicas)
            await kernel.shutdown()
            return QUORUM_LOST
        with anyio.move_on_after(_POLL_S):
            await kernel.closed.wait()
    return 0


async def _stop_on_signal(kernel: Kernel) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: shutting the kernel down", signum)
            await kernel.shutdown()
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbos.jupyter.host")
    parser.add_argument("-f", "--connection-file", required=True)
    parser.add_argument("--config", help="nbos TOML settings")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--gpus", type=_count, default=0, help="the kernel's GPUs per cell (kernelspec nbos.gpus)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    # Interrupts arrive as messages (interrupt_mode "message"); a terminal's Ctrl-C
    # meant for a console client must not take the whole kernel down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = Settings.load(args.config)
    return anyio.run(serve, Path(args.connection_file), settings, args.gpus)


def _count(text: str) -> int:
    if not text.isdecimal():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of GPUs")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
