"""Torch tensors as raw bytes, so their data can travel out of band.

torch's own pickling copies tensor data into the pickle stream; here a tensor is
reduced to a ``PickleBuffer`` over its (CPU, contiguous) bytes plus dtype, shape,
``requires_grad``, whether it is a ``Parameter``, and its ``.grad``. Tensors are
rebuilt on the CPU: placing them on a GPU is the residency layer's job.

torch is never imported here unless a value's type already comes from torch, so
the control plane imports this module without torch installed.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any


def reduce(obj: object, owners: dict[int, object]) -> Any:
    """A reduce tuple for a plain tensor or ``Parameter``; ``NotImplemented`` otherwise.

    Records in ``owners`` that the tensor owns the memory of the numpy view it exports.
    """
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return NotImplemented
    tensor: Any = obj
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return NotImplemented
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        owners[id(data)] = obj  # the view is the tensor's own memory, not a copy
    grad = tensor.grad if tensor.is_leaf else None
    meta = (
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
        tensor.requires_grad,
        type(obj) is torch.nn.Parameter,
    )
    return _rebuild, (pickle.PickleBuffer(data), meta, grad)


def _rebuild(buffer: Any, meta: tuple[str, tuple[int, ...], bool, bool], grad: Any) -> Any:
    import torch

    dtype, shape, requires_grad, param = meta
    raw = memoryview(buffer).cast("B")
    if raw.nbytes:
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(getattr(torch, dtype)).reshape(shape)
    if param:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    elif requires_grad:
        tensor.requires_grad_(True)
    if grad is not None:
        tensor.grad = grad
    return tensor
