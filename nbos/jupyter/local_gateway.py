"""Which gateway a Jupyter kernel runs on: the one the settings name, or the user's own.

``[gateway] address`` named in the settings (``NBOS_GATEWAY__ADDRESS``, or the TOML
file) is used as it is. Otherwise every kernel of the user goes to one per-user
local gateway: ``nbos gateway`` with local agents, started in the background by
the first kernel that finds none and announced in a runtime file in Jupyter's
runtime directory (``nbos-gateway.json``, see :mod:`nbos.gateway.runtime`). Its
lock makes two kernels starting at once start one gateway. It exits on its own
after ``[gateway] local_idle_exit_s`` without kernels.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path

import anyio
from jupyter_core.paths import jupyter_runtime_dir

from nbos.core.config import ENV_PREFIX, Settings
from nbos.core.errors import ConfigError, KernelError, TransportError
from nbos.core.private_files import open_private
from nbos.gateway.control_api import ClusterStatus, StatusRequest, call
from nbos.gateway.runtime import RuntimeFile
from nbos.transport.ports import free_loopback_ports

log = logging.getLogger(__name__)

RUNTIME_NAME = "nbos-gateway.json"
#: How long a new local gateway (its agents: one Python start each) may take to answer.
START_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 5.0
_ADDRESS_ENV = f"{ENV_PREFIX}GATEWAY__ADDRESS"
# A kernel's Jupyter variables mean nothing to the gateway, its agents and replicas.
_KERNEL_ONLY_ENV = ("JPY_PARENT_PID", "JPY_SESSION_NAME")


def runtime_file() -> RuntimeFile:
    """The per-user local gateway's runtime file (``$JUPYTER_RUNTIME_DIR`` honoured)."""
    return RuntimeFile(Path(jupyter_runtime_dir()) / RUNTIME_NAME)


def named_address(config: str | None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the settings name a gateway (``[gateway] address`` given, not defaulted)."""
    if _ADDRESS_ENV in env:
        return True
    if config is None:
        return False
    with Path(config).open("rb") as f:  # Settings.load read it already: it is valid TOML
        return "address" in tomllib.load(f).get("gateway", {})


def gateway_address(settings: Settings, config: str | None, cluster: str | None = None) -> str:
    """The control address of the gateway for this kernel: that of the cluster file
    ``cluster``, else the one the settings name, else the user's own (started if it
    does not run)."""
    if cluster is not None:
        from nbos.deploy import load_cluster_file

        return load_cluster_file(cluster).gateway.address
    if named_address(config):
        return settings.gateway.address
    return local_gateway(settings, runtime_file())


def local_gateway(settings: Settings, runtime: RuntimeFile) -> str:
    """The address of the gateway announced in ``runtime``; started first if none answers."""
    idle_s = settings.gateway.local_idle_exit_s
    if not idle_s > 0:
        raise ConfigError("gateway.local_idle_exit_s", idle_s, "positive seconds")
    with runtime.locked():
        found = runtime.read()
        if found is not None and _answers(found.address, _PROBE_TIMEOUT_S):
            return found.address
        process = _start(settings, runtime)
        return _wait_announced(process, runtime)


def _start(settings: Settings, runtime: RuntimeFile) -> subprocess.Popen[bytes]:
    control, agents = free_loopback_ports(2)
    env = {k: v for k, v in os.environ.items() if k not in _KERNEL_ONLY_ENV}
    env |= {
        _ADDRESS_ENV: f"127.0.0.1:{control}",
        f"{ENV_PREFIX}GATEWAY__AGENT_ADDRESS": f"127.0.0.1:{agents}",
        f"{ENV_PREFIX}GATEWAY__LOCAL_AGENTS": "true",
        f"{ENV_PREFIX}GATEWAY__IDLE_EXIT_S": str(settings.gateway.local_idle_exit_s),
    }
    argv = [sys.executable, "-m", "nbos", "--log-level", "INFO", "gateway"]
    argv += ["--runtime-file", str(runtime.path)]
    log_path = _log_path(runtime)
    with open_private(log_path) as out:
        # Its own session: a terminal's Ctrl-C for the Jupyter server, or the kernel
        # manager signalling this kernel's process group, must not reach it.
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=runtime.path.parent,
            start_new_session=True,
        )
    log.info("started the local nbos gateway, pid %d, log %s", process.pid, log_path)
    return process


def _wait_announced(process: subprocess.Popen[bytes], runtime: RuntimeFile) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        status = process.poll()
        if status is not None:
            raise KernelError(
                f"the local nbos gateway exited with status {status}; see {_log_path(runtime)}"
            )
        found = runtime.read()
        if found is not None and found.pid == process.pid and _answers(found.address, 1.0):
            return found.address
        time.sleep(0.1)
    process.kill()
    raise KernelError(
        f"the local nbos gateway did not start within {START_TIMEOUT_S:g} s; "
        f"see {_log_path(runtime)}"
    )


def _answers(address: str, timeout: float) -> bool:
    try:
        reply = anyio.run(call, address, StatusRequest(), timeout)
    except TransportError:
        return False
    return isinstance(reply, ClusterStatus)


def _log_path(runtime: RuntimeFile) -> Path:
    return runtime.path.with_suffix(".log")
