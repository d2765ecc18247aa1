"""One-shot results that driver tasks hand to callers blocked in ``propose`` or ``read_index``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

from nbos.core.errors import ProposalTimeoutError

T = TypeVar("T")


class Outcome(Generic[T]):
    """A value or an error, set once, awaited by one caller.

    ``on_done`` is called with the outcome the moment it is set or failed.
    """

    def __init__(self, on_done: Callable[[Outcome[T]], None] | None = None) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._on_done = on_done

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set(self, value: T) -> None:
        if not self.done:
            self._value = value
            self._event.set()
            self._done()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self._error = error
            self._event.set()
            self._done()

    def _done(self) -> None:
        if self._on_done is not None:
            self._on_done(self)

    def result(self) -> T:
        """The value, or the error raised; only once :attr:`done`."""
        if not self.done:
            raise RuntimeError("the outcome is not settled yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def wait(self) -> T:
        await self._event.wait()
        return self.result()


class PendingProposal:
    """A proposal waiting for its entry to be applied."""

    def __init__(
        self,
        client_id: str,
        seq: int,
        timeout: float = math.inf,
        on_done: Callable[[Outcome[bytes]], None] | None = None,
    ) -> None:
        self.client_id = client_id
        self.seq = seq
        self.timeout = timeout
        self.outcome: Outcome[bytes] = Outcome(on_done)

    def expire(self) -> None:
        self.outcome.fail(
            ProposalTimeoutError(
                f"proposal {self.client_id}/{self.seq} not applied within {self.timeout}s"
            )
        )


class Watermark:
    """A monotonically rising integer that tasks can wait on."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self._changed = anyio.Event()

    def advance(self, value: int) -> None:
        if value > self.value:
            self.value = value
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_for(self, value: int) -> None:
        while self.value < value:
            await self._changed.wait()
