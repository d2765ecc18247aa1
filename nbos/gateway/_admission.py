"""Admission of kernel starts: how many run at once, and when a refused client asks again.

A start costs the hosts three Python processes booting at once; a flood of them starved
the agents (whose silence then looked like failure) and hurt kernels that already ran.
So at most ``[gateway] max_starting`` starts run at once. One more waits at most
``[gateway] start_wait_s`` for a slot, then is refused with
:class:`~nbos.core.errors.OverloadedError`: never queued for longer, as a queue would hold
the client's connection as long as the flood lasts. The wait keeps the slots full in a
burst: a refused client asks again in whole seconds (``Retry-After``), and a slot that
ends meanwhile would stand empty until one wakes. The client is told to ask again when a
slot is likely free: once the oldest start under way is expected to end, at the time a
start takes now (smoothed over the starts that ended). Telling it the whole time a start
takes left slots empty for seconds in a burst, every refused client asleep.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from nbos.core.errors import ConfigError, OverloadedError
from nbos.metrics import ClusterEvent, events

log = logging.getLogger(__name__)

#: What a start is taken to last before one ended (a warm start on a quiet machine: ~2 s).
_FIRST_ESTIMATE_S = 5.0
#: How much each ended start moves the estimate.
_WEIGHT = 0.3
#: ``Retry-After`` stays within these (whole seconds, as HTTP says it).
_MIN_RETRY_S = 1.0
_MAX_RETRY_S = 60.0


class StartAdmission:
    """At most ``limit`` kernel starts at once; :meth:`wait` waits up to ``wait_s`` for
    a slot, :meth:`slot` refuses one more at once."""

    def __init__(self, limit: int, wait_s: float = 0.0) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError("gateway.max_starting", limit, "at least 1")
        if not (isinstance(wait_s, int | float) and 0 <= wait_s <= _MAX_RETRY_S):
            raise ConfigError("gateway.start_wait_s", wait_s, f"0 to {_MAX_RETRY_S:g} seconds")
        self.limit = limit
        self.wait_s = float(wait_s)
        #: When each start under way began (``time.monotonic()``).
        self._began: list[float] = []
        self._estimate_s = _FIRST_ESTIMATE_S
        #: Set when a start ends, for the starts waiting for a slot (made by the first).
        self._ended: anyio.Event | None = None

    @property
    def running(self) -> int:
        """Starts under way now."""
        return len(self._began)

    def retry_after_s(self) -> float:
        """Whole seconds after which a refused client should ask again: until the oldest
        start under way is expected to end (the whole estimate if none runs)."""
        wait = self._estimate_s
        if self._began:
            wait -= time.monotonic() - min(self._began)
        return min(max(math.ceil(wait), _MIN_RETRY_S), _MAX_RETRY_S)

    def refuse(self, reason: str) -> OverloadedError:
        """The error refusing a start for ``reason`` (logged here, the one place)."""
        error = OverloadedError(reason, self.retry_after_s())
        log.info("kernel start refused: %s", error)
        events().happened(ClusterEvent("refused", f"kernel start refused: {error}"))
        return error

    def check(self) -> None:
        """:class:`OverloadedError` if a start now would be refused."""
        if self.running >= self.limit:
            raise self.refuse(f"{self.running} kernels are starting, the most at once")

    async def wait(self) -> None:
        """Return once a start may run, having waited at most ``wait_s`` for one under way
        to end; :class:`OverloadedError` if none did. Waiting starts wake together, and
        the first to run on takes the slot (the others wait again)."""
        with anyio.move_on_after(self.wait_s):
            while self.running >= self.limit:
                if self._ended is None:
                    self._ended = anyio.Event()
                await self._ended.wait()
        self.check()

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one start's place for the block; :class:`OverloadedError` if none is free."""
        self.check()
        began = time.monotonic()
        self._began.append(began)
        ended = False
        try:
            yield
            ended = True
        finally:
            self._began.remove(began)
            if self._ended is not None:
                self._ended.set()
                self._ended = None
            if ended:
                took = time.monotonic() - began
                self._estimate_s += _WEIGHT * (took - self._estimate_s)
