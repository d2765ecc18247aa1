"""nbos on a real Docker Swarm of 5 nodes on this machine (``nbos swarm deploy``).

Five ``dockerd`` in five network namespaces (:mod:`tests._servers.swarm`), the image built
offline (``scripts/build-image.sh``) and loaded on each, the stack deployed: the gateway and
Redis on ``n1``; agents on ``n1``-``n4``; ``n5`` a standby node (availability ``drain``).
A user's Jupyter Server (``--gateway-url``) in a sixth namespace runs cells of a kernel
whose 3 replicas are containers on 3 nodes, through: ``docker kill`` of an agent's
container mid-cell, of the gateway's container, and of a whole node mid-cell (every process of its
engine) and its restart; a node drained (``docker node update --availability drain``), whose replica
the gateway moves to another node before its agent leaves; and a rolling ``docker service
update --image`` of the agents and the gateway.
The agents join with the join token of ``nbos keys --join-token`` (a Docker secret), each
with a key pair of its own. Every cell appends its number to ``done`` in the kernel: no
acknowledged cell is lost or run twice, and the kernel runs the next cell.

A second test deploys, on the same swarm, a stack whose gateway autoscales with the swarm's
standby node (``[swarm] autoscale = true``): cells holding every GPU and one more waiting,
``n5`` is made active and the waiting cell runs there; idle, a node is drained again.

Long (``NBOS_LONG=1``): the image build and the swarm take minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._servers._process import serve_or_skip
from tests._servers.swarm import Swarm, SwarmNode
from tests.agent._daemons import ROOT
from tests.deploy.conftest import REPORTS

pytestmark = [pytest.mark.long, pytest.mark.timeout(3600)]

NODES = ["n1", "n2", "n3", "n4", "n5"]
GPU_NODES = NODES[:4]
STANDBY = "n5"
IMAGE = "nbos:swarm-test"
SWARM_FILE = """\
[swarm]
stack = "nbos"
image = "nbos:swarm-test"
virtual_gpus = 2
keys = "keys"

[gateway]
# A loaded 2-core machine must not make agents look gone.
missed_heartbeats = 20
"""
_WAIT_S = 300.0
#: Lines of each service's log a failed test prints.
_FAILURE_LOG_LINES = 150


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image, built offline on a private engine and saved to a tarball."""
    workdir = tmp_path_factory.mktemp("image")
    swarm = serve_or_skip(lambda: Swarm.create(["builder"], workdir / "engine"), "a dockerd")
    engine = next(swarm)
    try:
        env = {**os.environ, "DOCKER_HOST": f"unix://{engine.manager.socket}"}
        env["NBOS_BUILD_PYTHON"] = sys.executable
        started = time.monotonic()
        subprocess.run(
            [str(ROOT / "scripts" / "build-image.sh"), "--tag", IMAGE], env=env, check=True
        )
        print(f"image built in {time.monotonic() - started:.0f} s", file=sys.stderr)
        tarball = workdir / "image.tar"
        engine.manager.docker("save", "-o", str(tarball), IMAGE, timeout_s=600)
        return tarball
    finally:
        next(swarm, None)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, image: Path) -> Iterator[Swarm]:
    """One swarm for the module's tests (each deploys its own stack on it)."""
    started = time.monotonic()
    workdir = tmp_path_factory.mktemp("swarm")
    nodes = serve_or_skip(lambda: Swarm.create(NODES, workdir, clients=["client"]), "a swarm")
    swarm = next(nodes)
    for node in swarm.nodes.values():  # what a node needs before the stack: its state dir
        (node.dir / "var-lib" / "nbos").mkdir()
    swarm.load_image(image)
    ids = swarm.node_ids()
    manager = swarm.manager
    manager.docker("node", "update", "--label-add", "nbos.gateway=true", ids["n1"])
    for name in [*GPU_NODES, STANDBY]:
        manager.docker("node", "update", "--label-add", "nbos.gpu=true", ids[name])
    manager.docker("node", "update", "--availability", "drain", ids[STANDBY])
    print(f"swarm up in {time.monotonic() - started:.0f} s", file=sys.stderr)
    yield swarm
    next(nodes, None)


@pytest.fixture(autouse=True)
def service_logs_on_failure(request: pytest.FixtureRequest, swarm: Swarm) -> Iterator[None]:
    """When a test failed, the last lines of the stack's services' logs (on its stderr):
    what the gateway and the agents saw is gone with the swarm."""
    yield
    call = request.node.stash.get(REPORTS, {}).get("call")
    if call is None or not call.failed:
        return
    for service in ("nbos_gateway", "nbos_agent"):
        argv = [
            "docker", "-H", f"unix://{swarm.manager.socket}", "service", "logs",
            "--timestamps", "--tail", str(_FAILURE_LOG_LINES), service,
        ]  # fmt: skip
        try:
            # What the services log goes to their stderr, which the command keeps apart.
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, check=False
            )
            logs = done.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as exc:
            logs = f"(no logs: {exc})"
        print(f"--- {service} ---\n{logs}", file=sys.stderr)


class User:
    """The driver of :mod:`tests.deploy._swarm_client` in the client namespace."""

    def __init__(self, swarm: Swarm, workdir: Path, token: str) -> None:
        gateway = swarm.nodes["n1"].address
        argv = swarm.net.argv(
            "client",
            [
                sys.executable, "-m", "tests.deploy._swarm_client",
                f"http://{gateway}:8888", f"{gateway}:7070", token, str(workdir),
            ],
        )  # fmt: skip
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        swarm.net.processes.append(self.process)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the client driver ended (its output is in the test's stderr)"
        answer: dict[str, Any] = json.loads(line)
        return answer


def nbos(swarm: Swarm, *args: str) -> None:
    """``nbos ARGS`` with the swarm's manager as the docker CLI's engine."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{swarm.manager.socket}", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "nbos", *args], env=env, check=True)


def deploy(swarm: Swarm, tmp_path: Path, text: str = SWARM_FILE) -> Path:
    swarm_file = tmp_path / "swarm.toml"
    swarm_file.write_text(text)
    nbos(swarm, "keys", str(tmp_path / "keys"), "--join-token")
    nbos(swarm, "swarm", "deploy", str(swarm_file))
    return swarm_file


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(1.0)


def operator_token(swarm: Swarm, state_dir: str = "nbos") -> str:
    path = swarm.nodes["n1"].dir / f"var-lib/{state_dir}/gateway/gateway/operator.token"
    wait_for("the gateway's operator token", path.exists)
    return path.read_text().strip()


def hosts_up(user: User) -> set[str]:
    status = user.ask(op="status")
    return {h["host_id"] for h in status.get("hosts", []) if h["state"] == "up"}


def replica_hosts(user: User, kernel: str) -> list[str]:
    for info in user.ask(op="status")["kernels"]:
        if kernel in (info["kernel_id"], info.get("api_id")):
            return [r["host"] for r in info["replicas"] if r["alive"]]
    raise AssertionError(f"kernel {kernel} not in the gateway's status")


def container(node: SwarmNode, service: str) -> str:
    """The running task container of ``service`` on ``node``."""
    found = node.docker(
        "ps", "-q", "--filter", f"label=com.docker.swarm.service.name=nbos_{service}"
    ).split()
    assert len(found) == 1, f"{service} on {node.name}: {found}"
    return found[0]


def replica_containers(node: SwarmNode) -> list[str]:
    return node.docker("ps", "-q", "--filter", "label=nbos.host").split()


class Cells:
    """Cells numbered 1, 2, ... each appending its number to the kernel's ``done``."""

    def __init__(self, user: User) -> None:
        self.user = user
        self.acknowledged: list[int] = []
        self.next = 1

    def send(self, seconds: float = 0.0) -> tuple[int, str]:
        number = self.next
        self.next += 1
        code = f"import time\ntime.sleep({seconds})\ndone.append({number})\nprint(done)"
        return number, self.user.ask(op="send", code=code)["msg_id"]

    def finish(self, number: int, msg_id: str) -> dict[str, Any]:
        reply = self.user.ask(op="finish", msg_id=msg_id)
        if reply["status"] == "ok":
            self.acknowledged.append(number)
        return reply

    def run(self, seconds: float = 0.0) -> dict[str, Any]:
        reply = self.finish(*self.send(seconds))
        assert reply["status"] == "ok", reply
        return reply

    def check(self) -> None:
        """The kernel's ``done`` is exactly the acknowledged cells, each once."""
        msg_id = self.user.ask(op="send", code="print(done)")["msg_id"]
        reply = self.user.ask(op="finish", msg_id=msg_id)
        assert reply["status"] == "ok", reply
        assert json.loads(reply["stdout"]) == self.acknowledged


def test_kernel_runs_through_engine_failures_and_upgrades(swarm: Swarm, tmp_path: Path) -> None:
    started = time.monotonic()
    swarm_file = deploy(swarm, tmp_path)
    user = User(swarm, tmp_path / "client", operator_token(swarm))
    wait_for("4 agents up", lambda: hosts_up(user) == set(GPU_NODES))
    assert not replica_containers(swarm.nodes[STANDBY])

    kernel = user.ask(op="start")["kernel"]
    placed = replica_hosts(user, kernel)
    assert len(set(placed)) == 3 and set(placed) <= set(GPU_NODES)
    for name in placed:  # replicas are containers on their node's own engine
        assert len(replica_containers(swarm.nodes[name])) == 1
    cells = Cells(user)
    cells.user.ask(op="finish", msg_id=user.ask(op="send", code="done = []")["msg_id"])
    cells.run()
    cells.check()

    # An agent's container killed mid-cell: Swarm restarts it, it takes its replicas back.
    number, msg_id = cells.send(seconds=5)
    time.sleep(1)
    victim = swarm.nodes[placed[0]]
    killed = container(victim, "agent")
    victim.docker("kill", killed)
    reply = cells.finish(number, msg_id)
    assert reply["status"] == "ok", reply
    wait_for("the agent's new container", lambda: _restarted(victim, "agent", killed))
    cells.run()
    cells.check()

    # The gateway's container killed: Swarm restarts it on its node; it takes the kernel back.
    gateway = swarm.nodes["n1"]
    killed = container(gateway, "gateway")
    gateway.docker("kill", killed)
    wait_for("the gateway's new container", lambda: _restarted(gateway, "gateway", killed))
    wait_for("the gateway back", lambda: _answers(user))
    user.ask(op="reconnect")
    cells.run()
    cells.check()

    # A whole node dies (its engine and every container on it): the kernel runs on with
    # 2 of its 3 replicas, the gateway replaces the third on the node that had none, and
    # the node comes back (a reboot: the engine restarts, Swarm its agent).
    # It dies mid-cell: a cell its replica ran is lost (CellLostError, once the replacement
    # on the spare node removed the silent member: the gateway has no proof of its death
    # before), one another replica ran ends as usual; either way only acknowledged cells
    # are in the kernel's list.
    placed = replica_hosts(user, kernel)
    name = next(n for n in placed if n != "n1")
    number, msg_id = cells.send(seconds=20)
    time.sleep(2)
    swarm.kill_node(name)
    reply = cells.finish(number, msg_id)
    assert reply["status"] == "ok" or reply["ename"] == "CellLostError", reply
    wait_for(f"{name} suspected", lambda: name not in hosts_up(user))
    cells.run()
    cells.check()
    spare = next(n for n in GPU_NODES if n not in placed)
    wait_for(
        f"{name}'s replica replaced on {spare}",
        lambda: sorted(replica_hosts(user, kernel)) == sorted({*placed, spare} - {name}),
    )
    swarm.start_node(name)
    wait_for(f"{name}'s agent back", lambda: hosts_up(user) == set(GPU_NODES))
    cells.run()
    cells.check()

    # A node drained: its agent, told to stop, waits while the gateway moves its replica
    # (a Raft membership change) to the node that has none; then Swarm stops the agent.
    placed = replica_hosts(user, kernel)
    drained = next(n for n in placed if n != "n1")
    spare = next(n for n in GPU_NODES if n not in placed)
    swarm.manager.docker("node", "update", "--availability", "drain", swarm.node_ids()[drained])
    wait_for(
        f"{drained}'s replica moved to {spare}",
        lambda: sorted(replica_hosts(user, kernel)) == sorted({*placed, spare} - {drained}),
    )
    wait_for(f"no replica left on {drained}", lambda: not replica_containers(swarm.nodes[drained]))
    cells.run()
    cells.check()

    # A rolling upgrade of the agents and the gateway keeps the kernel's namespace.
    for node in swarm.nodes.values():
        node.docker("tag", IMAGE, "nbos:swarm-test-2")
    for service in ("agent", "gateway"):
        swarm.manager.docker(
            "service", "update", "--detach", "--image", "nbos:swarm-test-2", f"nbos_{service}",
            timeout_s=600,
        )  # fmt: skip
    wait_for("the upgrade", lambda: _converged(swarm, "nbos:swarm-test-2"))
    wait_for("the gateway back", lambda: _answers(user))
    user.ask(op="reconnect")
    cells.run()
    cells.check()
    print(f"swarm test body: {time.monotonic() - started:.0f} s", file=sys.stderr)

    # nbos swarm rm: the stack's services, its config and its secrets go.
    nbos(swarm, "swarm", "rm", str(swarm_file))
    manager = swarm.manager
    wait_for("the stack's services gone", lambda: not manager.docker("service", "ls", "-q").split())
    assert not manager.docker("secret", "ls", "-q").split()
    wait_for("the stack's config gone", lambda: not manager.docker("config", "ls", "-q").split())


# The standby step's stack: 3 active nodes of one virtual GPU each, n5 standby (n4 out of
# it), the gateway autoscaling through the swarm provider with short timings. Its first
# decision waits a period: the agents, restarted by the deploy, register before it.
STANDBY_STATE = "nbos-standby"
ACTIVE = ["n1", "n2", "n3"]
STANDBY_FILE = f"""\
[swarm]
stack = "nbos"
image = "{IMAGE}"
state_dir = "/var/lib/{STANDBY_STATE}"
virtual_gpus = 1
keys = "keys"
autoscale = true

[gateway]
missed_heartbeats = 20
min_hosts = 3
max_hosts = 4
autoscale_period_s = 15
scale_out_cooldown_s = 10
scale_in_cooldown_s = 30
idle_grace_s = 20
"""


def test_a_standby_node_is_activated_for_waiting_cells_and_drained_when_idle(
    swarm: Swarm, tmp_path: Path
) -> None:
    started = time.monotonic()
    _fresh_swarm(swarm)
    swarm_file = deploy(swarm, tmp_path, STANDBY_FILE)
    user = User(swarm, tmp_path / "client", operator_token(swarm, STANDBY_STATE))
    wait_for("3 agents up", lambda: hosts_up(user) == set(ACTIVE))
    assert availability(swarm, STANDBY) == "drain"

    # Four kernels on the active nodes, placed while no GPU is busy: once every GPU is,
    # the subscription limit falls towards 1 (a moving average, by each change) and a
    # fourth kernel's replicas would fit nowhere (docs/placement.md: admission).
    hogs = [user.ask(op="start")["kernel"] for _ in ACTIVE]
    waiting = user.ask(op="start")["kernel"]
    # A cell of each of 3 kernels holds the GPU of each active node.
    for kernel in hogs:
        user.ask(op="send", kernel=kernel, code="import time\ntime.sleep(3600)")
    wait_for("every GPU held", lambda: gpus(user, "committed") == len(ACTIVE))
    # The fourth kernel's cell waits for a GPU: the autoscaler activates n5, Swarm starts
    # the agent there, and the cell runs on n5 (its replica migrated there).
    msg_id = user.ask(op="send", kernel=waiting, code="print('ran')")["msg_id"]
    reply = user.ask(op="finish", msg_id=msg_id)
    assert reply["status"] == "ok" and reply["stdout"] == "ran\n", reply
    assert availability(swarm, STANDBY) == "active"
    assert STANDBY in hosts_up(user)
    assert STANDBY in replica_hosts(user, waiting)
    activated_s = time.monotonic() - started

    # Idle (the kernels shut down): the autoscaler drains a node back to standby.
    for kernel in [*hogs, waiting]:
        assert user.ask(op="shutdown", kernel=kernel)["status"] == 204
    wait_for("a node drained", lambda: len(hosts_up(user)) == len(ACTIVE))
    labelled = [*ACTIVE, STANDBY]
    wait_for(
        "one standby node again",
        lambda: [availability(swarm, n) for n in labelled].count("drain") == 1,
    )
    print(
        f"standby activated after {activated_s:.0f} s, drained after "
        f"{time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    nbos(swarm, "swarm", "rm", str(swarm_file))


def _fresh_swarm(swarm: Swarm) -> None:
    """No stack, no replica container left by the test before; n1-n3 active, n5 standby,
    n4 out of the stack."""
    manager = swarm.manager
    if "nbos_agent" in manager.docker("service", "ls", "--format", "{{.Name}}").split():
        manager.docker("stack", "rm", "nbos")
    wait_for("no stack", lambda: not manager.docker("service", "ls", "-q").split())
    ids = swarm.node_ids()
    for node in swarm.nodes.values():
        for replica in replica_containers(node):
            node.docker("rm", "-f", replica)
        (node.dir / "var-lib" / STANDBY_STATE).mkdir(exist_ok=True)
    for name in ACTIVE:
        manager.docker("node", "update", "--availability", "active", ids[name])
    manager.docker("node", "update", "--label-rm", "nbos.gpu", ids["n4"])
    manager.docker("node", "update", "--availability", "drain", ids["n4"])
    manager.docker("node", "update", "--availability", "drain", ids[STANDBY])


def availability(swarm: Swarm, name: str) -> str:
    node = swarm.node_ids()[name]
    return swarm.manager.docker(
        "node", "inspect", node, "--format", "{{.Spec.Availability}}"
    ).strip()


def gpus(user: User, state: str) -> int:
    hosts = user.ask(op="status").get("hosts", [])
    return sum(int(h[state]) for h in hosts if h["state"] == "up")


def _restarted(node: SwarmNode, service: str, old: str) -> bool:
    running = node.docker(
        "ps", "-q", "--filter", f"label=com.docker.swarm.service.name=nbos_{service}"
    ).split()
    return bool(running) and old not in running


def _answers(user: User) -> bool:
    try:
        return bool(hosts_up(user))
    except (KeyError, AssertionError):
        return False


def _converged(swarm: Swarm, image: str) -> bool:
    for service in ("agent", "gateway"):
        tasks = swarm.manager.docker(
            "service", "ps", "--filter", "desired-state=running",
            "--format", "{{.Image}} {{.CurrentState}}", f"nbos_{service}",
        ).splitlines()  # fmt: skip
        if not tasks or not all(t.startswith(image) and "Running" in t for t in tasks):
            return False
    return True
