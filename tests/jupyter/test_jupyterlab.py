"""JupyterLab in headless Chromium on an nbos cluster, as notebook products use it.

One real ``nbos gateway --http`` (3 local hosts of 1 virtual GPU) and one real
``jupyter lab --gateway-url`` pointed at it serve the module: the lab's kernels are
the gateway's. The browser does what a person does (open a notebook, Shift+Enter),
the test reads the outcome from the DOM, and screenshots are kept under the tests'
tmp dirs for a person to look at.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import nbformat
import pytest

from nbos.jupyter.kernelspec import KERNEL_NAME
from tests._servers._process import serve_or_skip
from tests._servers.browser import Browser
from tests._servers.jupyterlab import Gateway, JupyterLab, start_jupyter_lab
from tests.gateway._http import KernelSocket, call, start_http_gateway, stop

pytestmark = pytest.mark.timeout(600)

NOTEBOOK = "nbos-e2e.ipynb"
CELLS = (
    "import os\nanswer = 21\nprint('hello from nbos')",
    # The executor's pid, then it runs until the test kills it.
    "import time\nprint(os.getpid(), flush=True)\ntime.sleep(600)",
    "print('after the kill:', answer * 2)\nos.getpid()",
)
#: Two users' notebooks: the first holds a GPU until the test lets go, the second waits.
HOLDER, WAITER = "user-a.ipynb", "user-b.ipynb"
HOLD = (
    "%%gpus 1\nimport os, time\nprint('holding', flush=True)\n"
    "while not os.path.exists({release!r}):\n    time.sleep(0.05)"
)
#: Generous: a busy 2-core machine starts a lab, a browser and three replicas.
DEADLINE_S = 120.0
TOKEN = "lab-gateway-secret"
#: The notebook on screen: notebooks opened before stay in the page, hidden.
SHOWN = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Touched by the GPU test: every cell holding a GPU then ends."""
    return tmp_path_factory.mktemp("release") / "release"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The nbos gateway the lab's kernels come from: 3 hosts of one GPU each."""
    tmp = tmp_path_factory.mktemp("gateway")
    process, url, log = start_http_gateway(tmp, TOKEN, {"NBOS_CLUSTER__GPUS_PER_HOST": "1"})
    yield Gateway(url, TOKEN)
    stop(process)
    assert process.returncode == 0, log.read_text()[-3000:]


def write_notebook(path: Path, codes: tuple[str, ...]) -> None:
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(code) for code in codes],
        metadata={
            "kernelspec": {"name": KERNEL_NAME, "display_name": "nbos", "language": "python"}
        },
    )
    nbformat.write(notebook, path)


@pytest.fixture(scope="module")
def lab(
    tmp_path_factory: pytest.TempPathFactory, gateway: Gateway, release: Path
) -> Iterator[JupyterLab]:
    root = tmp_path_factory.mktemp("lab-root")
    write_notebook(root / NOTEBOOK, CELLS)
    write_notebook(root / HOLDER, (HOLD.format(release=str(release)),))
    write_notebook(root / WAITER, ("%%gpus 1\nprint('ran on a GPU')",))
    workdir = tmp_path_factory.mktemp("lab")
    yield from serve_or_skip(
        lambda: start_jupyter_lab(workdir, root, gateway=gateway), "jupyterlab"
    )


def wait_for(browser: Browser, what: str, found: Callable[[], object]) -> object:
    """Poll ``found`` until it returns something true; fail naming ``what`` at the deadline."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def probe(_: object) -> object:
        try:
            return found()
        except (StaleElementReferenceException, OSError):
            return False  # the page redrew the element, or the API is busy: look again

    return WebDriverWait(browser.driver, DEADLINE_S, poll_frequency=0.2).until(
        probe, f"waited {DEADLINE_S:.0f} s for {what}"
    )


def cells(browser: Browser) -> list[object]:
    from selenium.webdriver.common.by import By

    return list(browser.driver.find_elements(By.CSS_SELECTOR, f"{SHOWN} .jp-Cell"))


def outputs(browser: Browser, cell: int) -> list[str]:
    """The text of cell ``cell``'s outputs, as the page shows them."""
    from selenium.webdriver.common.by import By

    found = browser.driver.find_elements(
        By.CSS_SELECTOR, f"{SHOWN} .jp-Cell:nth-child({cell + 1}) .jp-OutputArea-output"
    )
    return [element.text for element in found]


def shift_enter(browser: Browser) -> None:
    """Run the selected cell and select the next, as a person does."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    ActionChains(browser.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(
        Keys.SHIFT
    ).perform()


def new_kernel_idle(lab: JupyterLab, before: set[str]) -> bool:
    """A kernel not in ``before`` is up and idle (the notebook's kernel started)."""
    return any(k["id"] not in before and k["execution_state"] == "idle" for k in lab.api("kernels"))


def open_notebook(browser: Browser, lab: JupyterLab, name: str, cell_count: int) -> None:
    """Open ``name``, wait for its kernel, and put the first cell in command mode."""
    from selenium.webdriver.common.by import By

    before = {k["id"] for k in lab.api("kernels")}
    browser.driver.get(lab.page(f"lab/tree/{name}"))
    wait_for(browser, f"{name}'s cells", lambda: len(cells(browser)) == cell_count)
    wait_for(browser, f"{name}'s kernel to start", lambda: new_kernel_idle(lab, before))
    browser.driver.find_element(By.CSS_SELECTOR, f"{SHOWN} .jp-Cell .jp-InputPrompt").click()


@pytest.mark.long
def test_a_notebook_shows_its_executor_lost_mid_cell_and_runs_on(
    browser: Browser, lab: JupyterLab, tmp_path: Path
) -> None:
    driver = browser.driver
    # Command mode on the first cell: Shift+Enter runs it and selects the next.
    open_notebook(browser, lab, NOTEBOOK, len(CELLS))
    shift_enter(browser)
    wait_for(browser, "the print's output", lambda: outputs(browser, 0) == ["hello from nbos"])
    shift_enter(browser)
    wait_for(browser, "the running cell's pid", lambda: outputs(browser, 1))
    (shown,) = outputs(browser, 1)
    executor = int(shown)
    assert b"nbos" in Path(f"/proc/{executor}/cmdline").read_bytes(), "not a replica's pid"

    os.kill(executor, signal.SIGKILL)
    lost = wait_for(browser, "the lost cell's error", lambda: outputs(browser, 1)[1:])
    assert "CellLostError" in str(lost)
    shift_enter(browser)
    wait_for(browser, "the next cell's outputs", lambda: len(outputs(browser, 2)) == 2)
    printed, survivor = outputs(browser, 2)
    assert printed == "after the kill: 42"  # the namespace outlived its executor
    assert int(survivor) != executor

    screenshot = tmp_path / "jupyterlab.png"
    assert driver.save_screenshot(str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.long
def test_two_users_notebooks_contend_for_one_gpu_and_the_waiting_one_says_so(
    browser: Browser, lab: JupyterLab, gateway: Gateway, release: Path, tmp_path: Path
) -> None:
    # Two other clients of the gateway hold the GPUs of two of its three hosts.
    with gpus_held(gateway, 2, release):
        open_notebook(browser, lab, HOLDER, 1)
        shift_enter(browser)
        wait_for(browser, "user a's cell to hold the last GPU", lambda: outputs(browser, 0))
        assert outputs(browser, 0) == ["holding"]

        open_notebook(browser, lab, WAITER, 1)
        shift_enter(browser)
        shown = wait_for(browser, "user b's wait status", lambda: outputs(browser, 0))
        assert str(shown[0]).startswith("nbos: the cell waits"), shown  # type: ignore[index]
        waiting = tmp_path / "waiting.png"
        assert browser.driver.save_screenshot(str(waiting))

        release.touch()
        wait_for(browser, "user b's cell to run", lambda: len(outputs(browser, 0)) == 2)
        status, printed = outputs(browser, 0)
        assert status.startswith("nbos: the cell started after waiting")
        assert printed == "ran on a GPU"


@contextmanager
def gpus_held(gateway: Gateway, count: int, release: Path) -> Iterator[None]:
    """``count`` kernels of the gateway each hold a GPU until ``release`` exists."""
    held = threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            anyio.run(_hold, gateway, count, release, held)
        except BaseException as exc:  # reported by the test's thread
            failed.append(exc)
            held.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(4 * DEADLINE_S) and not failed, failed
    try:
        yield
    finally:
        release.touch()
        thread.join(4 * DEADLINE_S)
    assert not failed, failed


async def _hold(gateway: Gateway, count: int, release: Path, held: threading.Event) -> None:
    kernels: list[str] = []
    sockets: list[KernelSocket] = []
    try:
        for _ in range(count):
            status, model = await call(
                f"{gateway.url}/api/kernels", "POST", {"name": KERNEL_NAME}, gateway.auth_token
            )
            assert status == 201, model
            kernels.append(model["id"])
            channels = f"{gateway.url}/api/kernels/{model['id']}/channels"
            sockets.append(await KernelSocket.open(channels, gateway.auth_token))
        code = {"code": HOLD.format(release=str(release)), "silent": False}
        cells = [(ws, ws.send("shell", "execute_request", code)) for ws in sockets]
        for ws, msg_id in cells:
            while not _is_output_of(await ws.receive(), msg_id):
                pass
        held.set()
        for ws, msg_id in cells:
            reply, _ = await ws.finish(msg_id, timeout=4 * DEADLINE_S)
            assert reply["content"]["status"] == "ok", reply
    finally:
        for ws in sockets:
            ws.close()
        for kernel in kernels:
            await call(f"{gateway.url}/api/kernels/{kernel}", "DELETE", token=gateway.auth_token)


def _is_output_of(msg: dict[str, object], msg_id: str) -> bool:
    parent = msg.get("parent_header")
    return (
        isinstance(parent, dict)
        and parent.get("msg_id") == msg_id
        and (msg.get("msg_type") == "stream")
    )
