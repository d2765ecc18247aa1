"""An agent without keys runs any argv it is sent: it listens where only its own machine
reaches it, unless told ``--insecure``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nbos.agent import AgentConfig
from nbos.core.errors import ConfigError
from tests.agent._daemons import ROOT


@pytest.mark.parametrize("address", ["127.0.0.1:7001", "127.9.9.9:0", "[::1]:7001", "localhost:1"])
def test_a_keyless_agent_listens_on_loopback(address: str, tmp_path: Path) -> None:
    assert AgentConfig("h1", address, "127.0.0.1:2", tmp_path).address == address


@pytest.mark.parametrize("address", ["10.1.2.3:7001", "192.168.0.7:0", "gpu-7.lan:7001"])
def test_a_keyless_agent_elsewhere_is_refused_unless_insecure_or_keyed(
    address: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        AgentConfig("h1", address, "127.0.0.1:2", tmp_path)
    assert AgentConfig("h1", address, "127.0.0.1:2", tmp_path, insecure=True).insecure
    assert AgentConfig("h1", address, "127.0.0.1:2", tmp_path, keys=tmp_path / "keys").keys


def test_nbos_agent_refuses_a_keyless_address_others_reach(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "nbos", "agent", "--host", "h1", "--address", "10.1.2.3:7001"]
    argv += ["--gateway", "127.0.0.1:2", "--state-dir", str(tmp_path / "state")]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "--insecure" in done.stderr and "Traceback" not in done.stderr
