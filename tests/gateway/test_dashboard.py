"""The gateway's dashboard (``/dashboard/``), in headless Chromium and over its data endpoints.

One real ``nbos gateway --http`` (3 local hosts of 1 virtual GPU, a users file of alice,
bob and the admin carol) serves the module. The browser signs in as a person does and
the tests read what the page shows from the DOM: kernels started over the API appear
without a reload, their state follows their cells (busy while one runs, waiting while
one waits for a GPU), a killed replica's replacement shows in the event log, and bob
never sees alice's kernel. Deadlines are generous: how fast the page follows is
``bench/dashboard.py``'s business, not the tests'.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import attrs
import pytest

from nbos.core.identity import new_token
from nbos.gateway._dashboard import EventLog, percentile
from nbos.gateway.auth import users_file_entry
from nbos.gateway.control_api import ControlError, SignalReplica, call
from nbos.metrics import ClusterEvent
from nbos.transport.ports import free_loopback_ports
from tests._servers._process import serve_or_skip
from tests._servers.browser import Browser, start_browser
from tests.gateway._http import KernelSocket, start_http_gateway, stop
from tests.gateway._http import call as rest

pytestmark = pytest.mark.timeout(900)

#: Generous: a busy 2-core machine starts replicas, a browser and a gateway at once.
DEADLINE_S = 180.0
#: A cell that holds its GPU until ``release`` exists.
HOLD = (
    "%%gpus 1\nimport os, time\nprint('holding', flush=True)\n"
    "while not os.path.exists({release!r}):\n    time.sleep(0.05)"
)


@attrs.frozen
class Cluster:
    url: str
    control: str
    log: Path
    tokens: dict[str, str]
    release: Path
    users: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("dashboard")
    tokens = {name: new_token() for name in ("alice", "bob", "carol", "dave")}
    users = tmp / "users.toml"
    users.write_text(
        users_file_entry("alice", tokens["alice"])
        + users_file_entry("bob", tokens["bob"])
        + users_file_entry("carol", tokens["carol"], "admin")
        + users_file_entry("dave", tokens["dave"])
    )
    (control,) = free_loopback_ports(1)
    process, url, log = start_http_gateway(
        tmp,
        new_token(),
        {
            "NBOS_AUTH__USERS_FILE": str(users),
            "NBOS_CLUSTER__GPUS_PER_HOST": "1",
            "NBOS_GATEWAY__ADDRESS": f"127.0.0.1:{control}",
        },
    )
    yield Cluster(url, f"127.0.0.1:{control}", log, tokens, tmp / "release", users)
    stop(process)


@pytest.fixture(scope="module")
def portal() -> Iterator[anyio.from_thread.BlockingPortal]:
    """An event loop in a thread of its own for the tests' Jupyter clients."""
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    workdir = tmp_path_factory.mktemp("browser")
    yield from serve_or_skip(lambda: start_browser(workdir), "browser")


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    """A GET, as a client with ``token`` (``None``: none); its status and body."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def state(c: Cluster, user: str) -> dict[str, Any]:
    status, body = get(f"{c.url}/dashboard/api/state", c.tokens[user])
    assert status == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


def first_feed_event(c: Cluster, user: str) -> tuple[str, str]:
    """The feed's first event (``hello``) as ``user`` reads it: its name and raw data."""
    request = urllib.request.Request(f"{c.url}/dashboard/api/feed")
    request.add_header("Authorization", f"token {c.tokens[user]}")
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        kind = response.readline().decode().removeprefix("event: ").strip()
        data = response.readline().decode().removeprefix("data: ")
    return kind, data


def start_kernel(c: Cluster, user: str) -> str:
    status, model = anyio.run(
        rest, f"{c.url}/api/kernels", "POST", {"name": "nbos-gpu-1"}, c.tokens[user]
    )
    assert status == 201, model
    return str(model["id"])


def wait_for(browser: Browser, what: str, found: Callable[[], object]) -> object:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def probe(_: object) -> object:
        try:
            return found()
        except StaleElementReferenceException:
            return False  # the page redrew the element: look again

    return WebDriverWait(browser.driver, DEADLINE_S, poll_frequency=0.2).until(
        probe, f"waited {DEADLINE_S:.0f} s for {what}"
    )


def sign_in(browser: Browser, c: Cluster, user: str) -> None:
    """Open the dashboard in a fresh tab state and sign in with ``user``'s token."""
    from selenium.webdriver.common.by import By

    driver = browser.driver
    driver.get(f"{c.url}/dashboard/")
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    wait_for(browser, "the login form", lambda: driver.find_element(By.ID, "login").is_displayed())
    driver.find_element(By.ID, "token").send_keys(c.tokens[user])
    driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    wait_for(browser, "the board", lambda: driver.find_element(By.ID, "board").is_displayed())
    assert user in driver.find_element(By.ID, "who").text


def kernel_state(browser: Browser, kernel: str) -> str | None:
    """The state the page shows for ``kernel`` (``None``: no row for it)."""
    from selenium.webdriver.common.by import By

    rows = browser.driver.find_elements(By.CSS_SELECTOR, f'tr[data-kernel="{kernel}"] td.state')
    return rows[0].text if rows else None


def events_shown(browser: Browser, kind: str) -> list[str]:
    from selenium.webdriver.common.by import By

    found = browser.driver.find_elements(By.CSS_SELECTOR, f'#events li[data-kind="{kind}"]')
    return [e.text for e in found]


def test_the_event_log_keeps_the_latest_events_in_order_and_recent_waits() -> None:
    log = EventLog(maxlen=3)
    for n in range(5):
        log.happened(ClusterEvent("host-joined", f"host h{n} joined", host=f"h{n}"))
    assert [(seq, e.host) for seq, e in log.since(0)] == [(3, "h2"), (4, "h3"), (5, "h4")]
    assert [seq for seq, _ in log.since(4)] == [5] and log.since(5) == []
    for wait in (0.3, 0.1, 0.2):
        log.cell_waited(wait)
    assert sorted(log.waits(0.0)) == [0.1, 0.2, 0.3]
    assert percentile([0.3, 0.1, 0.2], 0.5) == 0.2
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    assert percentile([], 0.5) is None


def test_without_a_token_the_page_asks_for_one_and_its_data_is_refused(
    cluster: Cluster, browser: Browser
) -> None:
    from selenium.webdriver.common.by import By

    for path in ("state", "feed"):
        status, _ = get(f"{cluster.url}/dashboard/api/{path}")
        assert status == 401
        status, _ = get(f"{cluster.url}/dashboard/api/{path}", "not-a-token")
        assert status == 403
    status, page = get(f"{cluster.url}/dashboard/")
    assert status == 200 and b'id="login"' in page  # the page itself holds no data
    driver = browser.driver
    driver.get(f"{cluster.url}/dashboard/")
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    wait_for(browser, "the login form", lambda: driver.find_element(By.ID, "login").is_displayed())
    assert not driver.find_element(By.ID, "board").is_displayed()
    driver.find_element(By.ID, "token").send_keys("a-wrong-token")
    driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    wait_for(
        browser,
        "the refusal",
        lambda: "not known" in driver.find_element(By.ID, "login-error").text,
    )
    assert not driver.find_element(By.ID, "board").is_displayed()
    # The refusals are the admins' to read in the event log.
    refused = [e["text"] for e in state(cluster, "carol")["events"] if e["kind"] == "refused"]
    assert any("/dashboard/api/feed" in text and "no token" in text for text in refused), refused
    assert not [e for e in state(cluster, "bob")["events"] if e["kind"] == "refused"]


def test_kernels_appear_and_follow_their_cells_without_a_reload(
    cluster: Cluster,
    browser: Browser,
    portal: anyio.from_thread.BlockingPortal,
    tmp_path: Path,
) -> None:
    sign_in(browser, cluster, "carol")
    holders = [start_kernel(cluster, user) for user in ("alice", "bob", "carol")]
    for kernel in holders:
        wait_for(browser, f"kernel {kernel} on the page", lambda k=kernel: kernel_state(browser, k))
    waiter = start_kernel(cluster, "alice")
    wait_for(browser, "the fourth kernel", lambda: kernel_state(browser, waiter) == "idle")
    sockets = [
        portal.call(_socket, cluster, k, u)
        for k, u in zip(holders, ("alice", "bob", "carol"), strict=True)
    ]
    waiting = portal.call(_socket, cluster, waiter, "alice")
    try:
        # One cell holds the GPU of each host; the fourth kernel's cell has none to take.
        cells = [
            portal.call(_send, ws, HOLD.format(release=str(cluster.release))) for ws in sockets
        ]
        for kernel in holders:
            wait_for(
                browser,
                f"kernel {kernel} busy",
                lambda k=kernel: kernel_state(browser, k) == "busy",
            )
        last = portal.call(_send, waiting, "%%gpus 1\nprint('ran on a GPU')")
        wait_for(browser, "the waiting kernel", lambda: kernel_state(browser, waiter) == "waiting")
        # Kept for a person to look at (the tests' tmp dir): every GPU held, one cell waiting.
        assert browser.driver.save_screenshot(str(tmp_path / "waiting.png"))
        shown = state(cluster, "carol")
        row = next(k for k in shown["board"]["kernels"] if k["id"] == waiter)
        assert row["last_cell"]["waiting"] and row["last_cell"]["wait_s"] >= 0, row
        committed = [g for h in shown["board"]["hosts"] for g in h["gpus"] if g["kernel"]]
        assert {g["kernel"] for g in committed} == set(holders), committed
        cluster.release.touch()
        for ws, msg_id in zip(sockets, cells, strict=True):
            reply, _ = portal.call(_finish, ws, msg_id)
            assert reply["content"]["status"] == "ok", reply
        reply, _ = portal.call(_finish, waiting, last)
        assert reply["content"]["status"] == "ok", reply
        for kernel in [*holders, waiter]:
            wait_for(
                browser,
                f"kernel {kernel} idle",
                lambda k=kernel: kernel_state(browser, k) == "idle",
            )
    finally:
        for ws in [*sockets, waiting]:
            portal.call(_close, ws)


def test_a_user_sees_only_their_kernels_and_an_admin_sees_all(
    cluster: Cluster, browser: Browser
) -> None:
    alice = start_kernel(cluster, "alice")
    bob = start_kernel(cluster, "bob")
    sign_in(browser, cluster, "bob")
    wait_for(browser, "bob's kernel", lambda: kernel_state(browser, bob))
    assert kernel_state(browser, alice) is None
    assert alice not in browser.driver.page_source
    shown = state(cluster, "bob")
    assert {k["user"] for k in shown["board"]["kernels"]} == {"bob"}
    assert alice not in json.dumps(shown)
    kind, data = first_feed_event(cluster, "bob")
    assert kind == "hello" and bob in data and alice not in data
    admin = {k["id"] for k in state(cluster, "carol")["board"]["kernels"]}
    assert {alice, bob} <= admin
    sign_in(browser, cluster, "carol")
    wait_for(browser, "alice's kernel for the admin", lambda: kernel_state(browser, alice))
    assert kernel_state(browser, bob) is not None


def test_a_killed_replicas_replacement_shows_in_the_event_log(
    cluster: Cluster, browser: Browser
) -> None:
    kernel = start_kernel(cluster, "alice")
    sign_in(browser, cluster, "alice")
    wait_for(browser, "alice's kernel", lambda: kernel_state(browser, kernel) == "idle")
    row = next(k for k in state(cluster, "alice")["board"]["kernels"] if k["id"] == kernel)
    victim = row["replicas"][0]
    reply = anyio.run(
        _control, cluster, SignalReplica(row["nbos_id"], victim["node"], int(signal.SIGKILL))
    )
    assert not isinstance(reply, ControlError), reply
    found = wait_for(
        browser,
        "the replacement in the event log",
        lambda: [t for t in events_shown(browser, "replacement") if kernel in t],
    )
    assert isinstance(found, list)
    assert f"replica {victim['node']} on {victim['host']}" in found[0], found
    wait_for(browser, "the kernel whole again", lambda: kernel_state(browser, kernel) == "idle")
    # bob hears nothing of alice's kernel, not even its replacement.
    assert not [e for e in state(cluster, "bob")["events"] if e["kernel"] == kernel]


async def _control(c: Cluster, request: SignalReplica) -> object:
    return await call(c.control, request, token=c.tokens["carol"])


async def _socket(c: Cluster, kernel: str, user: str) -> KernelSocket:
    return await KernelSocket.open(f"{c.url}/api/kernels/{kernel}/channels", c.tokens[user])


async def _send(ws: KernelSocket, code: str) -> str:
    return ws.send("shell", "execute_request", {"code": code, "silent": False})


async def _close(ws: KernelSocket) -> None:
    ws.close()


async def _finish(ws: KernelSocket, msg_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return await ws.finish(msg_id, timeout=DEADLINE_S)


@pytest.mark.long  # the feed rechecks its token every 30 s
def test_the_feed_of_a_user_removed_from_the_users_file_ends(cluster: Cluster) -> None:
    request = urllib.request.Request(f"{cluster.url}/dashboard/api/feed")
    request.add_header("Authorization", f"token {cluster.tokens['dave']}")
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        assert response.readline() == b"event: hello\n"
        kept = cluster.users.read_text().split('[users."dave"]')[0]
        cluster.users.write_text(kept)
        removed = time.monotonic()
        while response.readline():  # pushed every half second until the feed ends
            assert time.monotonic() - removed < DEADLINE_S, "the feed went on"
    status, _ = get(f"{cluster.url}/dashboard/api/state", cluster.tokens["dave"])
    assert status == 403
