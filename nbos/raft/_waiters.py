"""One-shot results that driver tasks hand to callers blocked in ``propose`` or ``read_index``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Outcome(Generic[T]):
    """A value or an error, set once, awaited by one caller.

    ``on_set`` gets the value the moment it is set, on the setter's thread.
    """

    def __init__(self, on_set: Callable[[T], None] | None = None) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._on_set = on_set

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set(self, value: T) -> None:
        if not self.done:
            self._value = value
            self._event.set()
            if self._on_set is not None:
                self._on_set(value)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self._error = error
            self._event.set()

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


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
