"""Waiting in tests for what offers no event to await: other processes, reports on a timer."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def eventually(check: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll ``check`` until it holds; ``TimeoutError`` after ``timeout`` seconds.

    The deadline is generous: a loaded machine is slow, and a wait that succeeds ends
    at once, so only a failing test pays for it.
    """
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110 - nothing to await but the condition
            await anyio.sleep(0.01)
