"""The ``GpuBinder`` interface: binding GPUs to a replica for the span of one cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class GpuBinder(Protocol):
    """Moves a replica's GPU-resident state onto the devices it is given, and off again.

    ``CUDA_VISIBLE_DEVICES`` is fixed when a process starts, so binding cannot work
    through it: a replica process sees all of its host's devices and the binder
    decides which ones the user's tensors live on.

    * ``bind(devices)`` makes ``devices`` (host-local device indices) the ones the
      next cell uses and restores offloaded tensors, modules and optimizer state
      onto them. Binding the devices already bound is a no-op.
    * ``release(evict=...)`` ends the binding. With ``evict=True`` GPU-resident state
      moves to (pinned) host memory before it returns; with ``evict=False`` it
      stays resident (lazy eviction) until ``evict`` is called or another ``bind``
      gives it different devices.
    * Every path releases: a failing ``bind`` leaves nothing bound.
    """

    @property
    def bound(self) -> tuple[int, ...]:
        """Device indices bound now (empty when none)."""
        ...

    @property
    def resident(self) -> tuple[int, ...]:
        """Devices that still hold this replica's tensors (lazily not yet evicted)."""
        ...

    async def bind(self, devices: Sequence[int]) -> None:
        """Bind ``devices`` and bring resident state onto them."""
        ...

    async def release(self, *, evict: bool) -> None:
        """End the binding, evicting now or leaving state resident."""
        ...

    async def evict(self) -> None:
        """Move any resident state to host memory."""
        ...
