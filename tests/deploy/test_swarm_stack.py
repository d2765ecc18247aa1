"""The swarm file and the stack made from it (``nbos swarm deploy --output``), without a swarm.

What the stack does on a real swarm is ``test_swarm.py``'s (long); here: every key is
checked, the settings the stack owns are refused, and the stack places and configures what
the docs say.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nbos.cli.agent import route_address
from nbos.cli.main import main
from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.deploy import load_swarm_file, render_stack, write_stack

INSECURE = '[swarm]\nimage = "nbos:test"\nvirtual_gpus = 2\ninsecure = true\n'
AUTOSCALED = INSECURE + "autoscale = true\n"


def swarm_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarm.toml"
    path.write_text(text)
    return path


def test_the_stack_pins_the_gateway_and_runs_an_agent_on_every_gpu_node(tmp_path: Path) -> None:
    loaded = load_swarm_file(swarm_file(tmp_path, INSECURE + "[raft]\nfsync = 'always'\n"))
    stack, _ = render_stack(loaded, "10.0.0.1")
    services = stack["services"]
    for name in ("gateway", "redis"):
        assert services[name]["deploy"]["placement"]["constraints"] == [
            "node.labels.nbos.gateway==true"
        ]
        assert services[name]["deploy"]["restart_policy"]["condition"] == "any"
    # The gateway reads the nodes' availability through its node's (a manager's) engine.
    assert "/var/run/docker.sock" in [v["source"] for v in services["gateway"]["volumes"]]
    agent = services["agent"]
    assert agent["deploy"]["mode"] == "global"
    assert agent["deploy"]["placement"]["constraints"] == ["node.labels.nbos.gpu==true"]
    assert all(service["networks"] == ["host"] for service in services.values())
    assert stack["networks"]["host"] == {"external": True, "name": "host"}
    command = agent["command"][2]
    assert "--address auto:7100" in command and "--gateway 10.0.0.1:7071" in command
    assert "--gpus 2" in command and "--insecure" in command
    assert agent["environment"] == {"NBOS_NODE": "{{.Node.Hostname}}"}


def test_the_services_settings_are_the_files_tables_plus_the_stacks(tmp_path: Path) -> None:
    loaded = load_swarm_file(swarm_file(tmp_path, INSECURE + "[raft]\nfsync = 'always'\n"))
    path = write_stack(loaded, "10.0.0.1", tmp_path / "out")
    assert path == tmp_path / "out" / "stack.yml"
    settings = Settings.load(tmp_path / "out" / "nbos.toml", env={})
    assert settings.raft.fsync == "always"
    assert settings.gateway.address == "10.0.0.1:7070"
    assert settings.gateway.agent_address == "10.0.0.1:7071"
    assert not settings.gateway.local_agents
    assert settings.store.redis_url == "redis://10.0.0.1:6379/0"
    assert settings.cluster.data_dir == "/var/lib/nbos/gateway"
    assert settings.gateway.swarm_engine == "unix:///var/run/docker.sock"
    assert (settings.agent.runtime, settings.agent.docker_image) == ("docker", "nbos:test")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (INSECURE + "[gateway]\naddress = '1.2.3.4:7070'\n", "gateway.address"),
        (INSECURE + "[store]\nkind = 'local'\n", "store.kind"),
        (INSECURE + "[agent]\nruntime = 'process'\n", "agent.runtime"),
        (INSECURE + "stray = 1\n", "stray"),
        (INSECURE + "[raft]\nfsync = 'sometimes'\n", "raft.fsync"),
        ('[swarm]\nimage = "nbos:test"\n', "swarm.keys"),
        (
            INSECURE.replace("insecure = true", "insecure = true\nstate_dir = 'rel'"),
            "swarm.state_dir",
        ),
        (INSECURE.replace("virtual_gpus = 2", "virtual_gpus = -1"), "virtual_gpus"),
        ('[swarm]\nkeys = "nowhere"\n', "swarm.keys"),
        (INSECURE + "[gateway]\njoin_token_file = 't'\n", "gateway.join_token_file"),
        # The autoscaler's provider is the stack's ([swarm] autoscale), its keys need it.
        (INSECURE + "[gateway]\nhost_provider = 'local'\n", "gateway.host_provider"),
        (INSECURE + "[gateway]\nautoscale = true\n", "gateway.autoscale"),
        (INSECURE + "[gateway]\nmin_hosts = 4\n", "gateway.min_hosts"),
        (AUTOSCALED + "[gateway]\nmin_hosts = 5\nmax_hosts = 4\n", "gateway.max_hosts"),
        (INSECURE.replace("insecure", "autoscale = 'yes'\ninsecure"), "autoscale"),
    ],
)
def test_a_bad_swarm_file_is_refused_by_its_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_swarm_file(swarm_file(tmp_path, text))
    assert key in refused.value.key


def test_autoscale_makes_the_standby_nodes_the_gateways_host_provider(tmp_path: Path) -> None:
    loaded = load_swarm_file(swarm_file(tmp_path, AUTOSCALED + "[gateway]\nmax_hosts = 5\n"))
    write_stack(loaded, "10.0.0.1", tmp_path / "out")
    gateway = Settings.load(tmp_path / "out" / "nbos.toml", env={}).gateway
    assert gateway.autoscale and gateway.max_hosts == 5
    assert gateway.host_provider == "swarm"
    # Through the engine its container mounts, the nodes the agent service runs on.
    assert gateway.host_provider_options == {
        "engine": "unix:///var/run/docker.sock",
        "label": "nbos.gpu",
    }
    plain = load_swarm_file(swarm_file(tmp_path, INSECURE))
    write_stack(plain, "10.0.0.1", tmp_path / "plain")
    assert not Settings.load(tmp_path / "plain" / "nbos.toml", env={}).gateway.autoscale


def test_keys_become_docker_secrets(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    main(["keys", str(keys), "--join-token"])
    stack, settings = render_stack(
        load_swarm_file(swarm_file(tmp_path, '[swarm]\nkeys = "keys"\n')), "10.0.0.1"
    )
    assert set(stack["secrets"]) == {"gateway-key", "gateway-key-secret", "join-token"}
    assert stack["secrets"]["join-token"]["file"] == str(keys / "join.token")
    gateway, agent = stack["services"]["gateway"], stack["services"]["agent"]
    assert [s["target"] for s in agent["secrets"]] == ["/run/secrets/join-token"]
    assert "--join-token-file /run/secrets/join-token" in agent["command"][2]
    assert "--insecure" not in agent["command"][2]
    # The gateway's key directory is on its node's disk (it pins the agents' keys there).
    assert (
        "cp /run/secrets/gateway-key-secret /var/lib/nbos/gateway/keys/gateway.key_secret"
        in (gateway["command"][2])
    )
    assert '"keys" = "/var/lib/nbos/gateway/keys"' in settings
    assert '"join_token_file" = "/run/secrets/join-token"' in settings


def test_an_agent_address_auto_is_this_machines_address_towards_the_gateway() -> None:
    assert route_address("auto:7100", "127.0.0.1:7071") == "127.0.0.1:7100"
    assert route_address("10.0.0.5:7100", "127.0.0.1:7071") == "10.0.0.5:7100"
    with pytest.raises(ConfigError):
        route_address("auto:7100", "no-such-host.invalid:7071")


def test_the_swarm_files_in_docs_deploy_md_load(tmp_path: Path) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", docs.read_text(), re.S) if "[swarm]" in b]
    assert len(blocks) >= 2, "docs/deploy.md's swarm file and its standby example"
    main(["keys", str(tmp_path / "keys"), "--join-token"])
    for block in blocks:
        load_swarm_file(swarm_file(tmp_path, block))
