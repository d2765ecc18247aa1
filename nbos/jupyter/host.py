"""The kernel host process: one kernel on the gateway, for Jupyter.

Jupyter launches ``python -m nbos.jupyter.host -f CONNECTION_FILE`` through the
``nbos`` kernelspec and its provisioner. The process asks the gateway
(:mod:`nbos.jupyter.local_gateway`: the one the settings name, else the user's
own) for a kernel, and writes the kernel front's connection info, atomically,
to :func:`front_info_path` beside ``CONNECTION_FILE``; the provisioner hands it
to the kernel manager, which rewrites the connection file with it. With
``--reuse-connection`` (a restart) the new kernel's front takes the ports and
key that ``CONNECTION_FILE`` holds, so clients with open channels go on working.

It lives as long as the kernel does, watching it on the gateway (which holds the
kernel's lease meanwhile): it exits 0 once the kernel was shut down (by a client,
or by SIGTERM or SIGHUP to this process), 3 when the gateway reports the kernel
``dead`` (fewer than a quorum of replicas alive, and nothing bringing them back: it shuts
the kernel down first; one ``recovering`` is waited for), and 4 when the gateway stayed
unreachable for ``[gateway] orphan_grace_s``; so a process poll tells Jupyter
whether the kernel lives. Once its Jupyter client process (``JPY_PARENT_PID``)
is gone it shuts the kernel down after ``orphan_grace_s``; if this process is
killed, the gateway does so when the lease runs out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from nbos.core.config import Settings
from nbos.core.errors import ConfigError, KernelError, NbosError, TransportError
from nbos.gateway.control_api import (
    ControlError,
    ControlReply,
    KernelInfo,
    ShutdownKernel,
    StartKernel,
    WatchKernel,
    call,
)
from nbos.jupyter._front_file import front_info_path
from nbos.jupyter.local_gateway import gateway_address

log = logging.getLogger(__name__)

#: Exit status of a host whose kernel is dead.
KERNEL_DEAD = 3
#: Exit status of a host that could not reach its gateway for ``orphan_grace_s``.
GATEWAY_LOST = 4
START_TIMEOUT_S = 120.0
_WATCH_S = 1.0
_PARENT_POLL_S = 0.5
_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def write_connection_file(path: Path, kernel: KernelInfo, gateway: str) -> None:
    """Replace ``path`` atomically with the front's connection info."""
    data: dict[str, Any] = dict(kernel.connection)
    data["nbos"] = {
        "kernel_id": kernel.kernel_id,
        "replicas": len(kernel.replicas),
        "gateway": gateway,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def reused_connection(connection_file: Path) -> dict[str, str | int]:
    """The ports and key of ``connection_file``, for the restarted kernel's front."""
    try:
        data = json.loads(connection_file.read_text())
    except (OSError, ValueError) as exc:
        raise KernelError(f"cannot read the connection file {connection_file}: {exc}") from exc
    kept = {k: data[k] for k in _PORTS if isinstance(data.get(k), int) and data[k] > 0}
    if len(kept) != len(_PORTS) or not isinstance(data.get("key"), str):
        raise KernelError(f"{connection_file} has no ports and key to reuse")
    return {**kept, "key": data["key"]}


class _Host:
    """One kernel on the gateway at ``address``, watched until it ends."""

    def __init__(self, address: str, kernel: KernelInfo, grace_s: float) -> None:
        self.address = address
        self.kernel_id = kernel.kernel_id
        self.grace_s = grace_s
        self.status = 0

    async def shutdown(self) -> None:
        try:
            await call(self.address, ShutdownKernel(self.kernel_id), timeout=60.0)
        except TransportError as exc:
            log.warning("kernel %s: shutdown not confirmed: %s", self.kernel_id, exc)

    async def watch(self) -> None:
        """Return once the kernel ended or is dead, or the gateway was lost."""
        unreachable_since: float | None = None
        while True:
            try:
                reply = await call(
                    self.address, WatchKernel(self.kernel_id, _WATCH_S), timeout=_WATCH_S + 10
                )
            except TransportError as exc:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.grace_s:
                    log.error("kernel %s: gateway lost: %s", self.kernel_id, exc)  # noqa: TRY400
                    self.status = GATEWAY_LOST
                    return
                continue
            unreachable_since = None
            if isinstance(reply, ControlError):
                if reply.kind != "unknown":
                    log.error("kernel %s: the gateway refused: %s", self.kernel_id, reply.message)
                return  # it was shut down
            if isinstance(reply, KernelInfo) and reply.state == "dead":
                log.error("kernel %s is dead: %s", self.kernel_id, reply.replicas)
                await self.shutdown()
                self.status = KERNEL_DEAD
                return

    async def until_signalled(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                log.info("signal %d: shutting the kernel down", signum)
                await self.shutdown()
                return

    async def until_orphaned(self, parent: int) -> None:
        """Return ``grace_s`` after the client process ``parent`` ended, kernel shut down."""
        # ipykernel's rule: only a parent we started under can be watched by our ppid
        # (safe against pid reuse); else by whether the pid still exists.
        by_ppid = os.getppid() == parent
        while os.getppid() == parent if by_ppid else _exists(parent):  # noqa: ASYNC110
            await anyio.sleep(_PARENT_POLL_S)
        log.warning(
            "kernel %s: its client process %d is gone: shutting it down in %g s",
            self.kernel_id,
            parent,
            self.grace_s,
        )
        await anyio.sleep(self.grace_s)
        await self.shutdown()


async def start_kernel(address: str, request: StartKernel) -> ControlReply:
    """The gateway's answer to ``request``, asked again after the time it says while it is
    overloaded, for up to ``START_TIMEOUT_S`` in all."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        reply = await call(address, request, timeout=max(deadline - time.monotonic(), 1.0))
        if not isinstance(reply, ControlError) or reply.retry_after_s is None:
            return reply
        # Spread out: the kernels refused together do not all come back together.
        wait = reply.retry_after_s * random.uniform(1.0, 1.5)
        if time.monotonic() + wait >= deadline:
            return reply
        log.info("%s; asking again in %.1f s", reply.message, wait)
        await anyio.sleep(wait)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def serve(
    connection_file: Path,
    settings: Settings,
    address: str,
    gpus: int = 0,
    *,
    reuse: bool = False,
    env: Mapping[str, str] = os.environ,
) -> int:
    """Run one kernel (cells ask for ``gpus`` GPUs by default) until it ends; the exit status."""
    grace_s = settings.gateway.orphan_grace_s
    if not grace_s > 0:
        raise ConfigError("gateway.orphan_grace_s", grace_s, "positive seconds")
    connection = reused_connection(connection_file) if reuse else None
    request = StartKernel(gpus, connection=connection, lease_s=grace_s)
    reply = await start_kernel(address, request)
    if not isinstance(reply, KernelInfo):
        raise KernelError(f"the gateway at {address} did not start a kernel: {reply}")
    host = _Host(address, reply, grace_s)
    write_connection_file(front_info_path(connection_file), reply, address)
    log.info("kernel %s on the gateway at %s", reply.kernel_id, address)
    async with anyio.create_task_group() as tg:

        async def then_stop(task: Any, *args: Any) -> None:
            await task(*args)
            tg.cancel_scope.cancel()

        tg.start_soon(then_stop, host.until_signalled)
        parent = env.get("JPY_PARENT_PID", "")
        if parent.isdecimal() and int(parent) > 1:
            tg.start_soon(then_stop, host.until_orphaned, int(parent))
        await host.watch()
        tg.cancel_scope.cancel()
    return host.status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbos.jupyter.host")
    parser.add_argument("-f", "--connection-file", required=True)
    parser.add_argument("--config", help="nbos TOML settings")
    parser.add_argument(
        "--cluster", help="run on the gateway of this cluster file (nbos cluster up FILE)"
    )
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--gpus", type=_count, default=0, help="the kernel's GPUs per cell (kernelspec nbos.gpus)"
    )
    parser.add_argument(
        "--reuse-connection",
        action="store_true",
        help="a restart: the front takes the ports and key of the connection file",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    # Interrupts arrive as messages (interrupt_mode "message"); a terminal's Ctrl-C
    # meant for a console client must not take the whole kernel down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        settings = Settings.load(args.config)
        address = gateway_address(settings, args.config, args.cluster)
        return anyio.run(
            lambda: serve(
                Path(args.connection_file),
                settings,
                address,
                args.gpus,
                reuse=args.reuse_connection,
            )
        )
    except NbosError as exc:
        log.error("the nbos kernel did not start: %s", exc)  # noqa: TRY400 - the message says it all
        return 1


def _count(text: str) -> int:
    if not text.isdecimal():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of GPUs")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
