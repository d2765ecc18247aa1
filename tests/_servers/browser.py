"""A throwaway headless Chromium driven by selenium, for end-to-end tests of web UIs.

It uses Debian's ``chromium`` and ``chromium-driver`` (scripts/system-deps.sh
installs them); selenium is given both paths, so its Selenium Manager never looks
for (or downloads) a browser or driver. A fixture wraps :func:`start_browser` with
:func:`tests._servers._process.serve_or_skip`, which skips the test when either
binary is missing (:class:`BrowserUnavailableError`).

Every browser gets a fresh profile under ``workdir``. The background-networking
flags matter on a closed network: without them Chromium's own update, sync and
component requests fail and the browser refuses connections.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests._servers._process import ServerUnavailableError

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

BROWSERS = ("chromium", "chromium-browser")
DRIVER = "chromedriver"

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


class BrowserUnavailableError(ServerUnavailableError):
    """No Chromium, chromedriver or selenium here: tests that need a browser should skip."""


@dataclass
class Browser:
    """A running Chromium; ``driver`` is its selenium ``WebDriver``, ``log`` chromedriver's."""

    driver: WebDriver
    log: Path

    def stop(self) -> None:
        """Quit the browser and its driver (selenium ends the processes it started)."""
        self.driver.quit()


def start_browser(workdir: Path) -> Browser:
    """Start headless Chromium with a fresh profile in ``workdir``.

    Raises :class:`BrowserUnavailableError` if Chromium, chromedriver or selenium is missing.
    """
    binary = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which(DRIVER)
    if binary is None or driver is None:
        raise BrowserUnavailableError(
            "chromium or chromedriver is not installed (apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
    except ImportError as exc:
        raise BrowserUnavailableError("selenium is not installed (pip install selenium)") from exc
    workdir.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*FLAGS, f"--user-data-dir={workdir / 'profile'}"):
        options.add_argument(flag)
    log = workdir / "chromedriver.log"
    service = webdriver.ChromeService(executable_path=driver, log_output=str(log))
    return Browser(webdriver.Chrome(options=options, service=service), log)
