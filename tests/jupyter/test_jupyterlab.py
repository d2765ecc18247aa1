"""JupyterLab in headless Chromium on an nbos kernel: kill the executor mid-cell, go on.

One real ``jupyter lab`` serves the module. Its kernels are nbos kernels: today
through the ``nbos`` kernelspec (tests/jupyter/conftest.py installs it into
``JUPYTER_PATH``); the ``gateway`` fixture is the one switch to an nbos Kernel
Gateway (``--gateway-url``). The browser does what a person does (open the
notebook, Shift+Enter), the test reads the outcome from the DOM, and a screenshot
is kept under the test's tmp dir for a person to look at.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import nbformat
import pytest

from nbos.jupyter.kernelspec import KERNEL_NAME
from tests._servers._process import serve_or_skip
from tests._servers.browser import Browser
from tests._servers.jupyterlab import Gateway, JupyterLab, start_jupyter_lab

pytestmark = pytest.mark.timeout(600)

NOTEBOOK = "nbos-e2e.ipynb"
CELLS = (
    "import os\nanswer = 21\nprint('hello from nbos')",
    # The executor's pid, then it runs until the test kills it.
    "import time\nprint(os.getpid(), flush=True)\ntime.sleep(600)",
    "print('after the kill:', answer * 2)\nos.getpid()",
)
#: Generous: a busy 2-core machine starts a lab, a browser and three replicas.
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def gateway() -> Gateway | None:
    """Where the lab's kernels come from: ``None`` for its own kernelspecs (the ``nbos`` one)."""
    return None


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, gateway: Gateway | None) -> Iterator[JupyterLab]:
    root = tmp_path_factory.mktemp("lab-root")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(code) for code in CELLS],
        metadata={
            "kernelspec": {"name": KERNEL_NAME, "display_name": "nbos", "language": "python"}
        },
    )
    nbformat.write(notebook, root / NOTEBOOK)
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

    return list(browser.driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"))


def outputs(browser: Browser, cell: int) -> list[str]:
    """The text of cell ``cell``'s outputs, as the page shows them."""
    from selenium.webdriver.common.by import By

    found = browser.driver.find_elements(
        By.CSS_SELECTOR, f".jp-Notebook .jp-Cell:nth-child({cell + 1}) .jp-OutputArea-output"
    )
    return [element.text for element in found]


def shift_enter(browser: Browser) -> None:
    """Run the selected cell and select the next, as a person does."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    ActionChains(browser.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(
        Keys.SHIFT
    ).perform()


def kernel_idle(lab: JupyterLab) -> bool:
    kernels = lab.api("kernels")
    return len(kernels) == 1 and kernels[0]["execution_state"] == "idle"


def test_a_notebook_shows_its_executor_lost_mid_cell_and_runs_on(
    browser: Browser, lab: JupyterLab, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser.driver
    driver.get(lab.page(f"lab/tree/{NOTEBOOK}"))
    wait_for(browser, "the notebook's cells", lambda: len(cells(browser)) == len(CELLS))
    wait_for(browser, "the nbos kernel to start", lambda: kernel_idle(lab))
    # Command mode on the first cell: Shift+Enter runs it and selects the next.
    driver.find_element(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell .jp-InputPrompt").click()

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
