"""Settings and fixtures every test shares."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, settings

from tests._servers._process import serve_or_skip
from tests._servers.browser import Browser, start_browser
from tests._servers.dockerd import DockerDaemon, import_empty_image, start_dockerd
from tests.example_policy import install_example_policy

# Hypothesis's default 200 ms deadline and its too-slow health check measure the machine, not
# the code: on a loaded 2-core box they fail tests whose outcome is right. Every property
# test here runs without them; a test's own @settings only adds its sizes.
settings.register_profile(
    "nbos", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("nbos")

# Agents keep no pre-started replicas here (tests/agent/test_warm.py turns them on): two
# idle Pythons importing ipykernel per agent are CPU that most tests, starting agents and
# no kernel or one, would pay for nothing on a 2-core machine. NBOS_AGENT__WARM_REPLICAS
# set outside still wins (a run of the suite with pools on).
os.environ.setdefault("NBOS_AGENT__WARM_REPLICAS", "0")

#: Long end-to-end suites (``@pytest.mark.long``) run only when this is set: ``make test``
#: stays within its 15 minutes on 2 cores, and ``.ci/run`` runs everything.
LONG = os.environ.get("NBOS_LONG") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG:
        return
    skip = pytest.mark.skip(reason="a long end-to-end suite: NBOS_LONG=1 runs it (.ci/run does)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


#: A test still running this long after its pytest-timeout is hung where that cannot reach
#: (a teardown after the timeout fired, a call blocked in C): its worker ends, with the
#: processes it started, and xdist starts another, so a run of the suite always ends.
HUNG_AFTER_S = 120.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout"))
    watchdog = threading.Timer(limit + HUNG_AFTER_S, _end_hung_worker, args=(item.nodeid,))
    watchdog.daemon = True
    if limit > 0:
        watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _end_hung_worker(nodeid: str) -> None:
    sys.stderr.write(f"\n{nodeid} is hung past its timeout: this worker ends\n")
    faulthandler.dump_traceback(file=sys.stderr)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(1)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """Headless Chromium (Debian's, driven by selenium), one per module; skips without it."""
    workdir = tmp_path_factory.mktemp("browser")
    yield from serve_or_skip(lambda: start_browser(workdir), "Debian's chromium, chromium-driver")


@pytest.fixture(scope="session")
def installed_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example placement policy, installed once per session: a module once imported
    stays the one ``sys.modules`` holds, so every test must see the same install."""
    return install_example_policy(tmp_path_factory)


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    """One Docker engine for the whole session (the system's, or a private dockerd)."""
    # A short path: the daemon's unix socket path must stay under 108 bytes.
    yield from serve_or_skip(
        lambda: start_dockerd(tmp_path_factory.mktemp("dockerd")), "a Docker engine"
    )


@pytest.fixture(scope="session")
def docker_image(docker_daemon: DockerDaemon) -> str:
    return import_empty_image(docker_daemon)
