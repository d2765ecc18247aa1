"""The replicated kernel seen by a real Jupyter client: one kernel, state on every replica."""

from __future__ import annotations

import itertools
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from queue import Empty
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.session import Session

import nbos
from nbos.cluster import Kernel, LocalCluster
from nbos.core.errors import KernelError
from nbos.kernel.front import CellPlan, ChoiceRequest
from tests._digests import assert_replicas_agree
from tests.kernel.conftest import connected_client, replica_client

pytestmark = pytest.mark.anyio
#: A request's reply on a loaded machine (a first completion imports jedi: seconds of CPU).
REPLY_S = 60


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    async with nbos.LocalCluster(hosts=3, durable=False) as c:
        yield c


@pytest.fixture(scope="module")
async def kernel(cluster: LocalCluster) -> Kernel:
    return await cluster.start_kernel()


@pytest.fixture
async def client(kernel: Kernel) -> AsyncIterator[AsyncKernelClient]:
    async with connected_client(kernel) as c:
        await c.wait_for_ready(timeout=30)
        yield c


async def run(
    client: AsyncKernelClient, code: str, *, allow_stdin: bool = False, timeout: float = 30
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Execute ``code``; the reply and every IOPub message of the request, in order."""
    msg_id = client.execute(code, allow_stdin=allow_stdin, stop_on_error=False)
    return await collect(client, msg_id, timeout=timeout)


async def collect(
    client: AsyncKernelClient, msg_id: str, *, timeout: float = 30
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    messages = await published(client, msg_id, timeout=timeout)
    with anyio.fail_after(timeout):
        while True:
            reply = await client.get_shell_msg()
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply, messages


async def published(
    client: AsyncKernelClient, msg_id: str, *, timeout: float = 30
) -> list[dict[str, Any]]:
    """The IOPub messages of request ``msg_id``, up to its idle."""
    messages: list[dict[str, Any]] = []
    with anyio.fail_after(timeout):
        while True:
            msg = await client.get_iopub_msg()
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return messages


def stdout(messages: list[dict[str, Any]]) -> str:
    return "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )


async def test_cells_run_once_and_state_reaches_every_replica(
    kernel: Kernel, client: AsyncKernelClient
) -> None:
    cells = [
        "xs = [1, 2]\nalias = xs\nd = {'k': 1}",
        "def f(a):\n    return a + len(xs)\n"
        "class P:\n    def __init__(self, v):\n        self.v = v",
        "xs.append(3)\nd['k'] = 2\np = P(f(1))",
        "import math\nprint(p.v, alias is xs, math.floor(2.5))",
    ]
    counts = []
    for code in cells:
        reply, messages = await run(client, code)
        assert reply["content"]["status"] == "ok", reply["content"]
        counts.append(reply["content"]["execution_count"])
        statuses = [m["content"]["execution_state"] for m in messages if m["msg_type"] == "status"]
        assert statuses == ["busy", "idle"]
        assert {m["header"]["session"] for m in messages} == {kernel.front.session_id}
        assert reply["header"]["session"] == kernel.front.session_id
    assert stdout(messages) == "4 True 2\n"
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    await assert_replicas_agree(kernel)


async def test_execute_result_reports_executor_and_timings(kernel: Kernel) -> None:
    result = await kernel.execute("y = 6 * 7\nprint(y)")
    assert result.status == "ok"
    assert result.stdout == "42\n"
    assert result.executor in {r.node for r in kernel.replicas}
    assert result.run_s is not None and result.wait_s is not None
    assert result.run_s >= 0 and result.wait_s >= 0
    failed = await kernel.execute("1 / 0")
    assert failed.error == ("ZeroDivisionError", "division by zero")
    assert failed.execution_count is not None and result.execution_count is not None
    assert failed.execution_count > result.execution_count


async def test_kernel_info_complete_inspect_is_complete_history(
    client: AsyncKernelClient,
) -> None:
    await run(client, "some_long_name = 1")
    info = await client.kernel_info(reply=True, timeout=REPLY_S)
    assert info["content"]["status"] == "ok"
    assert info["content"]["protocol_version"] >= "5.3"
    complete = await client.complete("some_lo", reply=True, timeout=REPLY_S)
    assert "some_long_name" in complete["content"]["matches"]
    inspect = await client.inspect("len", reply=True, timeout=REPLY_S)
    assert inspect["content"]["found"] is True
    is_complete = await client.is_complete("for i in x:", reply=True, timeout=REPLY_S)
    assert is_complete["content"]["status"] == "incomplete"
    history = await client.history(hist_access_type="tail", n=5, reply=True, timeout=REPLY_S)
    assert history["content"]["status"] == "ok"


async def test_the_replicas_leave_debugpy_out_as_their_kernelspec_offers_no_debugger(
    client: AsyncKernelClient,
) -> None:
    info = await client.kernel_info(reply=True, timeout=REPLY_S)
    assert "debugger" not in info["content"].get("supported_features", [])
    loaded = "import sys\nprint(sorted(m for m in sys.modules if 'pydev' in m or 'debugpy' in m))"
    _, messages = await run(client, loaded)
    assert stdout(messages) == "[]\n"
    # A user's own import of debugpy still works.
    _, messages = await run(client, "import debugpy\nprint(debugpy.__name__)")
    assert stdout(messages) == "debugpy\n"


async def test_input_reaches_the_client_and_back(client: AsyncKernelClient) -> None:
    msg_id = client.execute("who = input('who? ')\nprint('hi', who)", allow_stdin=True)
    with anyio.fail_after(20):
        request = await client.get_stdin_msg()
    assert request["msg_type"] == "input_request"
    assert request["content"]["prompt"] == "who? "
    client.input("ada")
    reply, messages = await collect(client, msg_id)
    assert reply["content"]["status"] == "ok"
    assert stdout(messages) == "hi ada\n"


async def test_interrupt_reaches_the_executor(client: AsyncKernelClient) -> None:
    msg_id = client.execute("import time\ntime.sleep(60)")
    with anyio.fail_after(20):
        while True:  # wait until the cell runs
            msg = await client.get_iopub_msg()
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                break
    await anyio.sleep(0.3)
    interrupt = client.session.msg("interrupt_request", {})
    client.control_channel.send(interrupt)
    reply, _ = await collect(client, msg_id, timeout=20)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    after, _ = await run(client, "print('still here')")
    assert after["content"]["status"] == "ok"


async def test_a_cell_with_top_level_await_runs_and_replicates(kernel: Kernel) -> None:
    # A replica runs no shell channel thread; ipykernel still asks it for the thread that
    # cells run on whenever a cell awaits at top level.
    ran = await kernel.execute("import asyncio\nawait asyncio.sleep(0.01)\nawaited = 42")
    assert ran.status == "ok", ran.error
    await assert_replicas_agree(kernel)
    after = await kernel.execute("print(await asyncio.sleep(0, awaited))")
    assert after.stdout == "42\n"


async def test_a_replica_publishes_the_idle_of_a_request_but_no_busy(
    cluster: LocalCluster, kernel: Kernel
) -> None:
    # The front publishes every request's busy itself; a replica's idle still ends a
    # request whose reply did not come or whose counted output did not all arrive.
    async with replica_client(cluster, kernel, kernel.replicas[0].node) as direct:
        await direct.wait_for_ready(timeout=30)
        msg_id = direct.kernel_info()
        statuses: list[str] = []
        with anyio.fail_after(30):
            while "idle" not in statuses:
                msg = await direct.get_iopub_msg()
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
                    statuses.append(msg["content"]["execution_state"])
    assert statuses == ["idle"]


# Stands in for a SIGINT that lands in IPython's own steps around the user's code: IPython
# lets a KeyboardInterrupt through there (its input transformers are one such step).
ARM_INTERRUPT = """
def _interrupt_once(lines):
    if any("interrupt here" in line for line in lines):
        get_ipython().input_transformers_post.remove(_interrupt_once)
        raise KeyboardInterrupt
    return lines
get_ipython().input_transformers_post.append(_interrupt_once)
"""


async def test_an_interrupt_outside_the_users_code_ends_the_cell_not_the_replica(
    kernel: Kernel,
) -> None:
    # asyncio re-raises a KeyboardInterrupt out of the replica's event loop: it ended the
    # executor, and the interrupted cell came back as lost (CellLostError).
    armed = await kernel.execute(ARM_INTERRUPT)
    assert armed.status == "ok"
    hit = await kernel.execute("x = 1  # interrupt here")
    assert hit.error is not None and hit.error[0] == "KeyboardInterrupt"
    after = await kernel.execute("print('still here')")
    assert after.stdout == "still here\n" and after.executor == armed.executor


async def test_bad_messages_are_refused_and_the_kernel_keeps_serving(
    kernel: Kernel, client: AsyncKernelClient, caplog: pytest.LogCaptureFixture
) -> None:
    info = kernel.connection_info
    wrong = Session(key=b"not-the-key")
    unsigned = Session(key=b"")
    right = Session(key=info["key"].encode())
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{info['ip']}:{info['shell_port']}")
    refused_before = kernel.front.refused
    code = {"code": "pwned = 1", "silent": False}
    try:
        with caplog.at_level(logging.WARNING, logger="nbos.kernel.front"):
            for session in (wrong, unsigned):
                await sock.send_multipart(session.serialize(session.msg("execute_request", code)))
            good = right.serialize(right.msg("execute_request", code))
            await sock.send_multipart([*good[:3], b"{not json", *good[4:]])  # bad header
            await sock.send_multipart([b"garbage"])  # no delimiter at all
            with anyio.fail_after(10):
                # The front's counter is the only thing a refusal changes; poll it.
                while kernel.front.refused < refused_before + 4:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
    finally:
        sock.close(0)
        ctx.term()
    assert sum("client message refused" in r.getMessage() for r in caplog.records) >= 4
    reply, messages = await run(client, "print('pwned' in dir())")
    assert reply["content"]["status"] == "ok"
    assert stdout(messages) == "False\n"


async def test_unpicklable_names_are_named_once_and_sync_goes_on(
    kernel: Kernel, client: AsyncKernelClient
) -> None:
    reply, messages = await run(client, "import threading\nlock = threading.Lock()\nok = 1")
    assert reply["content"]["status"] == "ok"
    told = "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"
    )
    assert "lock" in told and "ok" not in told.replace("cannot", "")
    again, messages = await run(client, "ok += 1")
    assert again["content"]["status"] == "ok"
    assert not [m for m in messages if m["msg_type"] == "stream"]
    digests = await kernel.digests()
    assert len(set(digests.values())) == 1


async def test_comm_messages_reach_the_kernel_through_the_log(client: AsyncKernelClient) -> None:
    register = (
        "seen = []\n"
        "def on_open(comm, msg):\n"
        "    seen.append(msg['content']['data'])\n"
        "    comm.send({'echo': msg['content']['data']})\n"
        "get_ipython().kernel.comm_manager.register_target('nbos-test', on_open)"
    )
    reply, _ = await run(client, register)
    assert reply["content"]["status"] == "ok"
    comm_open = client.session.msg(
        "comm_open", {"comm_id": "c-1", "target_name": "nbos-test", "data": {"n": 7}}
    )
    client.shell_channel.send(comm_open)
    with anyio.fail_after(20):
        while True:
            msg = await client.get_iopub_msg()
            mine = msg["parent_header"].get("msg_id") == comm_open["header"]["msg_id"]
            if mine and msg["msg_type"] == "comm_msg":
                break
    assert msg["content"]["data"] == {"echo": {"n": 7}}
    _, messages = await run(client, "print(seen)")
    assert stdout(messages) == "[{'n': 7}]\n"


class DeviceChooser:
    """Hands out the device ids of ``plans`` in turn and records what it released."""

    def __init__(self, plans: list[tuple[int, ...]]) -> None:
        self.plans = plans
        self.released: list[CellPlan] = []

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        return CellPlan(request.alive[0], self.plans.pop(0))

    async def release(self, plan: CellPlan) -> None:
        self.released.append(plan)


async def test_chooser_devices_reach_the_cell_and_every_plan_is_released(
    cluster: LocalCluster,
) -> None:
    chooser = DeviceChooser([(3,), (), (), (0,), ()])
    k = await cluster.start_kernel(chooser=chooser)
    try:
        show = "from nbos.gpu import devices\nprint(devices())"
        assert (await k.execute(show)).stdout == "(3,)\n"
        assert (await k.execute(show)).stdout == "()\n"
        made = await k.execute("import torch\nt = torch.ones(2)\nprint(torch.cuda.is_available())")
        bound = await k.execute("print(t.device)")
        if made.stdout == "False\n" and cluster.gpus.inventory.source == "virtual":
            # Virtual GPUs: a bound cell's tensors stay in host memory.
            assert bound.stdout == "cpu\n"
        after = await k.execute("print(t.sum().item())")
        assert after.stdout == "2.0\n"
        assert [p.devices for p in chooser.released] == [(3,), (), (), (0,), ()]
    finally:
        await k.shutdown()


async def test_a_failed_cell_aborts_the_cells_queued_behind_it(
    client: AsyncKernelClient,
) -> None:
    first = client.execute("1 / 0")
    second = client.execute("queued_after_error = 1")
    error, _ = await collect(client, first)
    aborted, messages = await collect(client, second)
    assert error["content"]["status"] == "error"
    assert aborted["content"]["status"] == "aborted"
    assert [m["content"]["execution_state"] for m in messages] == ["busy", "idle"]
    _, out = await run(client, "print('queued_after_error' in dir())")
    assert stdout(out) == "False\n"


class SlowReleaseChooser:
    """The last executor, and a release that takes a while (as a GPU grant's does)."""

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        last = request.last_executor
        return CellPlan(last if last in request.alive else request.alive[0])

    async def release(self, plan: CellPlan) -> None:
        await anyio.sleep(0.3)


async def test_a_cell_sent_after_a_failed_cells_idle_is_not_aborted(
    cluster: LocalCluster,
) -> None:
    # As with ipykernel, only what was queued when the failed cell ended is aborted. The
    # front published the failed cell's idle, then released its plan and only then looked
    # at its queue: a cell that the client sent on that idle was in it by then, and was
    # aborted (seen through Jupyter Server, with a GPU kernel).
    k = await cluster.start_kernel(chooser=SlowReleaseChooser())
    try:
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            for _ in range(5):
                failed, _ = await collect(c, c.execute("1 / 0", stop_on_error=True))
                assert failed["content"]["status"] == "error"
                after, _ = await collect(c, c.execute("after_error = 1", stop_on_error=True))
                assert after["content"]["status"] == "ok"
            # What was queued behind a failed cell is still aborted.
            first = c.execute("1 / 0", stop_on_error=True)
            second = c.execute("queued = 1", stop_on_error=True)
            assert (await collect(c, first))[0]["content"]["status"] == "error"
            assert (await collect(c, second))[0]["content"]["status"] == "aborted"
    finally:
        await k.shutdown()


class GatedReleaseChooser:
    """The last executor; a release that returns only once the test opens its gate."""

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.released = 0

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        last = request.last_executor
        return CellPlan(last if last in request.alive else request.alive[0])

    async def release(self, plan: CellPlan) -> None:
        await self.gate.wait()
        self.gate = anyio.Event()
        self.released += 1


async def test_a_cells_idle_goes_out_before_its_plan_is_released(cluster: LocalCluster) -> None:
    # The idle is due once the reply went out and the replica's idle came, whichever came
    # first: the client does not wait for the front to unwind the request.
    chooser = GatedReleaseChooser()
    k = await cluster.start_kernel(chooser=chooser)
    try:
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            for n in range(10):
                reply, messages = await collect(c, c.execute(f"n = {n}"), timeout=30)
                assert reply["content"]["status"] == "ok"
                assert messages[-1]["content"]["execution_state"] == "idle"
                assert chooser.released == n
                chooser.gate.set()
                with anyio.fail_after(30):
                    while chooser.released == n:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
    finally:
        chooser.gate.set()
        await k.shutdown()


async def test_shutdown_request_stops_every_replica(cluster: LocalCluster) -> None:
    k = await cluster.start_kernel()
    async with connected_client(k) as c:
        await c.wait_for_ready(timeout=30)
        reply = await c.shutdown(reply=True, timeout=20)
    assert reply["content"]["status"] == "ok"
    with anyio.fail_after(20):
        await k.closed.wait()
    assert not any(r.alive for r in k.replicas)
    for r in k.replicas:  # ended by the request (0) or, past the grace, by SIGTERM
        assert await k.wait_replica(r.node) in (0, -15)
    with pytest.raises(KernelError):
        await k.execute("1")


# A shell that notes the SIGTERM it gets, as the replica's shutdown sends first (what ends
# a replica's process group after it exits sends SIGKILL, which nobody can note).
NOTES_ITS_TERM = """
import subprocess
script = 'trap "echo term > $0; exit 0" TERM; sleep 300 & wait'
child = subprocess.Popen(['sh', '-c', script, {note!r}])
print(child.pid)
"""


async def test_a_shutdown_request_ends_the_processes_its_cells_started(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    note = tmp_path / "term"
    k = await cluster.start_kernel()
    async with connected_client(k) as c:
        await c.wait_for_ready(timeout=30)
        reply, messages = await run(c, NOTES_ITS_TERM.format(note=str(note)))
        assert reply["content"]["status"] == "ok", reply["content"]
        child = int(stdout(messages))
        assert running(child)
        reply = await c.shutdown(reply=True, timeout=20)
    assert reply["content"]["status"] == "ok"
    with anyio.fail_after(20):
        await k.closed.wait()
    assert not running(child)
    assert note.read_text() == "term\n"  # the replica ended it, not its group's SIGKILL


class RoundRobinChooser:
    """Sends each cell to the next live replica, never to the last executor."""

    def __init__(self) -> None:
        self.turn = 0

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        self.turn += 1
        return CellPlan(request.alive[self.turn % len(request.alive)])

    async def release(self, plan: CellPlan) -> None:
        return None


class HoldingChooser:
    """Picks a replica other than the last executor once the test lets it, and cannot be
    interrupted meanwhile (as a chooser finishing a GPU grant it already won)."""

    def __init__(self) -> None:
        self.choosing = anyio.Event()
        self.proceed = anyio.Event()

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        self.choosing.set()
        with anyio.CancelScope(shield=True):
            await self.proceed.wait()
        others = [r for r in request.alive if r != request.last_executor]
        return CellPlan(others[0] if others else request.alive[0])

    async def release(self, plan: CellPlan) -> None:
        return None


async def test_an_interrupt_that_comes_before_its_cell_is_sent_follows_it(
    cluster: LocalCluster,
) -> None:
    # The interrupt went to the last executor (not the cell's) with nothing running
    # there, and was dropped: the cell then ran its whole minute.
    chooser = HoldingChooser()
    chooser.proceed.set()
    k = await cluster.start_kernel(chooser=chooser)
    try:
        assert (await k.execute("x = 1")).status == "ok"
        chooser.choosing, chooser.proceed = anyio.Event(), anyio.Event()
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            msg_id = c.execute("import time\ntime.sleep(60)", stop_on_error=False)
            with anyio.fail_after(30):
                await chooser.choosing.wait()
            reply = await requested(c, "interrupt_request", {}, control=True)
            assert reply is not None and reply["content"]["status"] == "ok"
            chooser.proceed.set()
            interrupted, _ = await collect(c, msg_id, timeout=30)
        assert interrupted["content"]["ename"] == "KeyboardInterrupt"
        assert (await k.execute("print(x)")).stdout == "1\n"
    finally:
        await k.shutdown()


async def test_cells_moving_between_replicas_each_run_once(cluster: LocalCluster) -> None:
    """The last executor claims the next cell early; when the cell goes elsewhere the front
    retires that index and the cell runs once, on the chosen replica, under a new index."""
    k = await cluster.start_kernel(chooser=RoundRobinChooser())
    try:
        results = []
        for i in range(4):
            results.append(await k.execute(f"n = {i} if {i} == 0 else n + 1\nprint(n)"))
            await anyio.sleep(0.3)  # time for the executor's early claim of the next index
        assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
        # Cells 2 to 4 each found their first index claimed early by the last executor.
        assert k.front.last_exec_index == 7
        executors = [r.executor for r in results]
        assert all(a != b for a, b in itertools.pairwise(executors))
        counts = [r.execution_count for r in results]
        assert counts == [1, 2, 3, 4]
        await assert_replicas_agree(k)
    finally:
        await k.shutdown()


class RecordingChooser(RoundRobinChooser):
    """Round robin, recording each choice (index, the lost attempt it retries, the plan) and
    each release, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, CellPlan | None, CellPlan]] = []

    async def choose(self, request: ChoiceRequest) -> CellPlan:
        plan = await super().choose(request)
        self.events.append(("choose", request.exec_index, request.retry_of, plan))
        return plan

    async def release(self, plan: CellPlan) -> None:
        self.events.append(("release", 0, None, plan))


async def test_a_cell_whose_claim_lost_is_retried_with_its_lost_plan_released_after(
    cluster: LocalCluster,
) -> None:
    """The second cell's first index was claimed early by the first cell's executor: the
    retry's choice names the lost attempt's plan (``retry_of``), whose release comes only
    after it, so a chooser can hand the retry the lost attempt's GPUs; every plan is
    released once."""
    chooser = RecordingChooser()
    k = await cluster.start_kernel(chooser=chooser)
    try:
        assert (await k.execute("n = 1")).status == "ok"
        await anyio.sleep(0.3)  # time for the executor's early claim of the next index
        assert (await k.execute("print(n)")).stdout == "1\n"
    finally:
        await k.shutdown()
    chosen = [e for e in chooser.events if e[0] == "choose"]
    assert [(index, retry_of is None) for _, index, retry_of, _ in chosen] == [
        (1, True),
        (2, True),
        (3, False),
    ]
    lost, retry = chosen[1][3], chosen[2]
    assert retry[2] is lost
    order = [e[3] for e in chooser.events]
    released = [i for i, e in enumerate(chooser.events) if e[0] == "release"]
    assert sorted(id(chooser.events[i][3]) for i in released) == sorted(id(c[3]) for c in chosen)
    assert next(i for i in released if order[i] is lost) > chooser.events.index(retry)


async def test_late_output_of_a_finished_cell_still_reaches_the_client(
    client: AsyncKernelClient,
) -> None:
    code = (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()"
    )
    msg_id = client.execute(code)
    reply, _ = await collect(client, msg_id)
    assert reply["content"]["status"] == "ok"
    with anyio.fail_after(10):
        while True:
            msg = await client.get_iopub_msg()
            mine = msg["parent_header"].get("msg_id") == msg_id
            if mine and msg["msg_type"] == "stream":
                break
    assert msg["content"]["text"] == "late\n"


# A replica whose idle, and the cell's last output before it, come seconds after its
# reply (a loaded machine): the cell's stdout holds its text back until the flush ipykernel
# makes after the reply, and that flush is slow.
LATE_FLUSH = """
import sys, time
class _LateFlush:
    def __init__(self, real):
        self.real, self.text, self.flushes = real, [], 0
    def write(self, text):
        self.text.append(text)
        return len(text)
    def flush(self):
        self.flushes += 1
        if self.flushes == 2:  # the one after the reply
            time.sleep(3)
            sys.stdout = self.real
            self.real.write("".join(self.text))
            self.real.flush()
sys.stdout = _LateFlush(sys.stdout)
print("after the reply")
"""


async def test_output_sent_late_before_the_replicas_idle_still_comes_before_the_idle(
    client: AsyncKernelClient,
) -> None:
    # The front once gave up on the replica's idle 2 s after the reply and published its
    # own: the output that followed came after the cell's idle, lost to a client that
    # reads a cell up to its idle (seen on a loaded machine after a kernel restart).
    reply, messages = await run(client, LATE_FLUSH)
    assert reply["content"]["status"] == "ok"
    assert stdout(messages) == "after the reply\n"


# Holds the executor's idle of every cell once the test arms it (a file), until the test
# opens it (another file); the reply has gone out by then.
GATE_REPLICA_IDLE = """
def _install():
    import os, time
    session = get_ipython().kernel.session
    send = session.send
    def gated(stream, msg_or_type, content=None, *args, **kwargs):
        parent = kwargs.get("parent") or {{}}
        if (
            msg_or_type == "status"
            and (content or {{}}).get("execution_state") == "idle"
            and parent.get("header", {{}}).get("msg_type") == "execute_request"
            and os.path.exists({armed!r})
        ):
            os.remove({armed!r})
            while not os.path.exists({opened!r}):
                time.sleep(0.005)
        return send(stream, msg_or_type, content, *args, **kwargs)
    session.send = gated
_install()
del _install
"""


async def test_a_cells_idle_goes_out_once_the_output_its_reply_counts_is_relayed(
    client: AsyncKernelClient, tmp_path: Path
) -> None:
    # The reply says how many IOPub messages the replica published before it: the front
    # relays those and then its idle, without waiting for the replica's own idle. The gate
    # that holds the replica's idle is installed by the cell itself: a gate installed by a
    # cell before it stayed on that cell's executor, and on a loaded machine the next cell
    # may go to another replica (it did in CI: no gate, and the wait below timed out).
    armed, opened = tmp_path / "armed", tmp_path / "open"
    gate = GATE_REPLICA_IDLE.format(armed=str(armed), opened=str(opened))
    armed.touch()
    try:
        reply, messages = await run(client, f"{gate}\nprint('counted')\ndisplay('shown')")
        assert reply["content"]["status"] == "ok"
        assert "nbos_iopub" not in reply["metadata"]
        assert stdout(messages) == "counted\n"
        assert [m["msg_type"] for m in messages] == [
            "status",
            "execute_input",
            "stream",
            "display_data",
            "status",
        ]
        with anyio.fail_after(30):
            while armed.exists():  # noqa: ASYNC110 (the replica got to its idle: it holds it)
                await anyio.sleep(0.01)
    finally:
        opened.touch()
    # Wherever the next cell runs: the gate is only on the replica that ran this one.
    removed, _ = await run(client, "get_ipython().kernel.session.__dict__.pop('send', None)")
    assert removed["content"]["status"] == "ok"


async def requested(
    client: AsyncKernelClient, msg_type: str, content: dict[str, Any], *, control: bool = False
) -> dict[str, Any] | None:
    """Send a signed request; once its idle is out, its reply (``None`` if it got none).

    The reply of a request the front answers comes before its idle; one it ignores has
    only the busy/idle pair.
    """
    msg = client.session.msg(msg_type, content)
    channel = client.control_channel if control else client.shell_channel
    channel.send(msg)
    messages = await published(client, msg["header"]["msg_id"])
    statuses = [m["content"]["execution_state"] for m in messages if m["msg_type"] == "status"]
    assert statuses == ["busy", "idle"]
    get = client.get_control_msg if control else client.get_shell_msg
    while True:
        try:
            reply: dict[str, Any] = await get(timeout=2)
        except Empty:
            return None
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply


# (msg_type, content, answered with an error reply): the rest is logged and ignored.
BAD_SHELL_REQUESTS = [
    ("bogus_request", {}, False),
    ("execute_request", {}, True),
    ("execute_request", {"code": 5}, True),
    ("execute_request", {"code": "bad = 1", "user_expressions": 3}, True),
    ("complete_request", {}, True),
    ("history_request", {"hist_access_type": "tail", "output": 0, "raw": True}, True),
    ("comm_open", {"data": {}}, False),
    ("nbos_digest_request", {}, False),
    ("nbos_lost_request", {"exec_index": 1}, False),
]


async def test_signed_requests_of_unknown_type_or_bad_content_never_block_the_shell(
    cluster: LocalCluster,
) -> None:
    k = await cluster.start_kernel()
    try:
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            for n, (msg_type, content, answered) in enumerate(BAD_SHELL_REQUESTS):
                refused = k.front.refused
                reply = await requested(c, msg_type, content)
                assert k.front.refused == refused + 1, msg_type
                if answered:
                    assert reply is not None, msg_type
                    assert reply["content"]["status"] == "error", reply
                    assert reply["msg_type"] == msg_type.replace("_request", "_reply")
                else:
                    assert reply is None, reply
                after, messages = await run(c, f"print({n})")
                assert after["content"]["status"] == "ok", (msg_type, after["content"])
                assert stdout(messages) == f"{n}\n"
            _, out = await run(c, "print('bad' in dir())")
            assert stdout(out) == "False\n"
        await assert_replicas_agree(k)
    finally:
        await k.shutdown()


async def test_an_unknown_control_request_never_blocks_the_control_channel(
    cluster: LocalCluster,
) -> None:
    k = await cluster.start_kernel()
    try:
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            refused = k.front.refused
            internal = ("nbos_digest_request", "nbos_leader_gone_request")
            for msg_type in ("bogus_request", "execute_request", *internal):
                content = {"code": "x = 1"} if msg_type == "execute_request" else {"node": 1}
                assert await requested(c, msg_type, content, control=True) is None
            assert k.front.refused == refused + 4
            info = await requested(c, "kernel_info_request", {}, control=True)
            assert info is not None and info["content"]["status"] == "ok"
            assert "kernel subshells" not in info["content"].get("supported_features", [])
            interrupt = await requested(c, "interrupt_request", {}, control=True)
            assert interrupt is not None and interrupt["content"]["status"] == "ok"
            bad = await requested(c, "shutdown_request", {"restart": "yes"}, control=True)
            assert bad is not None and bad["content"]["status"] == "error"
            # A replica's handler that fails sends no reply (ipykernel logs it); the
            # front answers for it once the replica went idle.
            range_of_no_session = {
                "hist_access_type": "range", "output": False, "raw": False, "session": None
            }  # fmt: skip
            failed = await requested(c, "history_request", range_of_no_session, control=True)
            assert failed is not None and failed["content"]["status"] == "error"
            assert failed["content"]["ename"] == "KernelError"
            _, messages = await run(c, "print('x' in dir())")
            assert stdout(messages) == "False\n"
    finally:
        await k.shutdown()


# A forked child and a subprocess that print in a loop, and one that is quiet (all
# bounded, should a run fail): one that prints dies of a broken pipe once its replica
# is gone, a quiet one would live on.
CHILDREN = """
import os, subprocess, time
pid = os.fork()
if pid == 0:
    for _ in range(600):
        os.write(1, b'forked child\\n')
        print('forked child print', flush=True)
        time.sleep(0.1)
    os._exit(0)
popen = subprocess.Popen(['sh', '-c', 'for i in $(seq 600); do echo popen child; sleep 0.1; done'])
quiet = subprocess.Popen(['sleep', '60'])
# One write of one line to the pipe is atomic: the children's lines cannot cut into it
# (a print could be flushed in pieces with a child's line between them).
os.write(1, f'children {pid} {popen.pid} {quiet.pid}\\n'.encode())
"""


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_cells_children_print_as_that_cell_and_end_with_its_replica(
    cluster: LocalCluster,
) -> None:
    k = await cluster.start_kernel()
    try:
        async with connected_client(k) as c:
            await c.wait_for_ready(timeout=30)
            reply, messages = await run(c, CHILDREN)
            assert reply["content"]["status"] == "ok", reply["content"]
            lines = stdout(messages).splitlines()
            # What they print later is output of the cell that started them... The cell's
            # own last line may come after its idle too: written to fd 1, it is read from
            # the pipe by ipykernel's thread, which a loaded machine may run late. So may
            # the cell's stderr (nbos's note that the Popen objects stay on this replica),
            # which is not what the children print.
            late: set[str] = set()
            with anyio.fail_after(30):
                while len(late) < 3 or not any(x.startswith("children") for x in lines):
                    msg = await c.get_iopub_msg()
                    mine = msg["parent_header"].get("msg_id") == reply["parent_header"]["msg_id"]
                    stream = msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout"
                    if mine and stream:
                        text = msg["content"]["text"].splitlines()
                        lines += text
                        late.update(x for x in text if x and not x.startswith("children"))
            line = next(x for x in lines if x.startswith("children"))
            children = [int(pid) for pid in line.split()[1:]]
            assert late == {"forked child", "forked child print", "popen child"}
            # ...and never of a later cell.
            _, messages = await run(c, "import time\ntime.sleep(1)\nprint('later')")
            assert stdout(messages) == "later\n"
            assert all(running(pid) for pid in children)
        # The replica that started them crashes (its process alone is killed, as the
        # kernel's OOM killer would): they end with it.
        executor = next(r for r in k.replicas if r.node == k.front.last_executor)
        assert executor.pid is not None
        os.kill(executor.pid, signal.SIGKILL)
        with anyio.fail_after(30):
            while any(running(pid) for pid in children):  # noqa: ASYNC110 - /proc has no event
                await anyio.sleep(0.1)
    finally:
        await k.shutdown()
