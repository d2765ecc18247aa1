"""Binding GPUs to a replica for the span of one cell: :class:`TorchGpuBinder`.

``CUDA_VISIBLE_DEVICES`` is read once, when CUDA initialises in a process, so
it cannot follow a binding that changes from cell to cell. A replica process
therefore sees every device of its host, and binding works on the user's
objects instead:

* ``bind(devices)`` records the devices the cell may use (user code asks
  :func:`devices` / :func:`device` for them) and moves the namespace's tensors,
  modules and optimizer state onto the first of them;
* ``release(evict=True)`` moves them into pinned host memory, so the devices are
  free for another kernel; ``release(evict=False)`` leaves them where they are
  (lazy eviction: the host agent calls :meth:`evict` only when another kernel
  is about to get the device, so a kernel that runs again on the same device
  pays nothing).

Tensors are moved in place (``tensor.data = ...``, ``module.to(...)``), so every
name and container that refers to a tensor still refers to the same object:
aliasing in the namespace survives a move. torch is imported lazily; without it
the binder binds device ids and moves nothing.

There is no ``GpuBinder`` Protocol to plug another binder in: the replica kernel makes
its binder itself, from its own namespace (with a host-memory target on virtual GPUs),
and what user code reads (:func:`devices`, :func:`device`) is this module's state, so
a binder of another framework belongs here, not in a user's package behind a setting.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import anyio

log = logging.getLogger(__name__)

Namespace = MutableMapping[str, Any]

_bound: tuple[int, ...] = ()


def devices() -> tuple[int, ...]:
    """The GPU indices bound to the cell running now (empty outside a GPU cell)."""
    return _bound


def device() -> Any:
    """The ``torch.device`` a cell should put its work on: the first bound GPU, else the CPU."""
    import torch

    if _bound and torch.cuda.is_available():
        return torch.device("cuda", _bound[0])
    return torch.device("cpu")


class TorchGpuBinder:
    """Moves a namespace's torch state between GPUs and pinned host memory.

    ``namespace`` returns the user namespace (it can change between cells).
    ``target`` maps a device index to the ``torch.device`` to move onto; the
    default is ``cuda:<index>``. Tests on machines without CUDA pass a CPU target
    to exercise the same walk.

    Binding the devices already bound is a no-op; a failing ``bind`` leaves nothing
    bound; ``release(evict=False)`` leaves tensors resident until :meth:`evict` or a
    ``bind`` to other devices.
    """

    def __init__(
        self, namespace: Callable[[], Namespace], target: Callable[[int], Any] | None = None
    ) -> None:
        self._namespace = namespace
        self._target = target or _cuda
        self._resident: tuple[int, ...] = ()

    @property
    def bound(self) -> tuple[int, ...]:
        """Device indices bound now (empty when none)."""
        return _bound

    @property
    def resident(self) -> tuple[int, ...]:
        """Devices that still hold this replica's tensors (lazily not yet evicted)."""
        return self._resident

    async def bind(self, devices: Sequence[int]) -> None:
        """Bind ``devices`` (host-local indices) and bring resident state onto them."""
        global _bound  # noqa: PLW0603 - one binding per replica process, read by user code
        wanted = tuple(devices)
        if wanted == _bound:
            return
        if wanted and self._resident != wanted and _torch_loaded():
            await anyio.to_thread.run_sync(self._move, self._target(wanted[0]), False)
        _bound = wanted
        self._resident = wanted if wanted and _torch_loaded() else ()

    async def release(self, *, evict: bool) -> None:
        """End the binding, evicting now or leaving state resident."""
        global _bound  # noqa: PLW0603
        if _bound and _torch_loaded():
            # A cell that imported torch itself may have put tensors on its devices.
            self._resident = _bound
        _bound = ()
        if evict:
            await self.evict()

    async def evict(self) -> None:
        """Move any resident state to host memory."""
        if not self._resident:
            return
        import torch

        with anyio.CancelScope(shield=True):  # half-moved state would be worse than late
            await anyio.to_thread.run_sync(self._move, torch.device("cpu"), True)
        log.debug("evicted tensors from devices %s", self._resident)
        self._resident = ()

    def _move(self, target: Any, pin: bool) -> None:
        import torch

        pin = pin and torch.cuda.is_available()
        tensors = list(_tensors(_torch_objects(self._namespace())))
        moved = sum(_move_tensor(t, target, pin) for t in tensors)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        log.debug("moved %d of %d tensors to %s", moved, len(tensors), target)


def _cuda(index: int) -> Any:
    import torch

    return torch.device("cuda", index)


def _torch_loaded() -> bool:
    # The namespace can only hold torch objects if the user imported torch.
    return "torch" in sys.modules


def _torch_objects(namespace: Namespace) -> Iterator[Any]:
    """Tensors, modules and optimizers reachable from the namespace through containers."""
    import torch

    seen: set[int] = set()
    stack: list[Any] = list(namespace.values())
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor | torch.nn.Module | torch.optim.Optimizer):
            yield value
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            stack.extend(value)


def _tensors(objects: Iterator[Any]) -> Iterator[Any]:
    """Every tensor the objects hold, each once (a parameter is in a module and its optimizer)."""
    import torch

    seen: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            found = _module_tensors(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            found = _optimizer_tensors(obj)
        else:
            found = iter([obj])
        for tensor in found:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor


def _module_tensors(module: Any) -> Iterator[Any]:
    for parameter in module.parameters():
        yield parameter
        if parameter.grad is not None:
            yield parameter.grad
    yield from module.buffers()


def _optimizer_tensors(optimizer: Any) -> Iterator[Any]:
    import torch

    for group in optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.state.values():
        for key, value in state.items():
            # Optimizers keep scalar `step` counters on the CPU unless capturable; moving
            # them onto a GPU makes the next step() refuse them.
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                yield value


def _move_tensor(tensor: Any, target: Any, pin: bool) -> int:
    if tensor.device == target and not pin:
        return 0
    if pin:
        import torch

        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor.data, non_blocking=True)
        tensor.data = staged
    else:
        tensor.data = tensor.data.to(target, non_blocking=True)
    return 1
