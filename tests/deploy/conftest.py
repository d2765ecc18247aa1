"""Fixtures for the deployment tests: anyio on asyncio (the control API client is zmq.asyncio)."""

from __future__ import annotations

from collections.abc import Generator

import pytest

#: A test's reports by phase (``setup``, ``call``, ``teardown``).
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test, for fixtures that explain a failure."""
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report
