"""A canonical digest of a namespace: equal on every replica that holds equal state.

Deterministic across processes: names are sorted, functions and classes are
digested by their code and attributes rather than by address, arrays and tensors
by dtype, shape and bytes, sets by their sorted element digests, and shared
objects as back-references in walk order (so aliasing is part of the digest, but
``id()`` never is). Names whose values cannot be pickled are left out, as they are
left out of replication.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from nbos.kernel.state._buffers import LARGE
from nbos.kernel.state._codec import pickle_loadable
from nbos.kernel.state._names import user_items
from nbos.kernel.state._pickler import CLASS_SKIP, DESCRIPTORS, by_value

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_CODE_FIELDS = (
    "co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_flags", "co_code",
    "co_consts", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_name",
    "co_qualname",
)  # fmt: skip


def namespace_digest(namespace: Mapping[str, object]) -> str:
    """The hex digest of the user state in ``namespace`` (see the module docstring)."""
    walker = _Walker()
    total = hashlib.sha256()
    for name, value in sorted(user_items(namespace), key=lambda item: item[0]):
        if not _replicated(name, value):
            continue
        mark = walker.mark()
        try:
            part = walker.digest(value)
        except Exception:  # a value no reduce protocol describes is not replicated either
            walker.rewind(mark)
            continue
        total.update(name.encode() + b"\0" + part)
    return total.hexdigest()


def _replicated(name: str, value: object) -> bool:
    """Whether capture would carry ``value`` to replicas (so both sides digest it)."""
    if isinstance(value, types.ModuleType):
        return sys.modules.get(value.__name__) is value
    _, failed = pickle_loadable({name: value}, LARGE)
    return not failed


class _Walker:
    """Digests values; objects seen before digest as ``ref:<order seen>``."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}
        self._keep: list[object] = []

    def mark(self) -> int:
        return len(self._keep)

    def rewind(self, mark: int) -> None:
        for obj in self._keep[mark:]:
            del self._seen[id(obj)]
        del self._keep[mark:]

    def digest(self, obj: object) -> bytes:
        h = hashlib.sha256()
        self._feed(h, obj)
        return h.digest()

    def _feed(self, h: Any, obj: object) -> None:
        if isinstance(obj, _ATOMS):
            h.update(f"{type(obj).__name__}:{obj!r};".encode())
            return
        if isinstance(obj, tuple | frozenset):  # identity of immutables is not state
            self._container(h, obj)
            return
        if id(obj) in self._seen:
            h.update(f"ref:{self._seen[id(obj)]};".encode())
            return
        self._seen[id(obj)] = len(self._keep)
        self._keep.append(obj)
        self._container(h, obj)

    def _container(self, h: Any, obj: object) -> None:
        cls = type(obj)
        h.update(f"<{cls.__module__}.{cls.__qualname__}>".encode())
        special = _SPECIAL.get(cls)
        if special is not None:
            special(self, h, obj)
        elif isinstance(obj, types.ModuleType):
            h.update(obj.__name__.encode())
        elif isinstance(obj, type) and by_value(obj):
            self._class(h, obj)
        elif isinstance(obj, types.FunctionType) and by_value(obj):
            self._function(h, obj)
        elif isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
            h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
        elif _array_like(obj):
            self._array(h, obj)
        elif isinstance(obj, pickle.PickleBuffer):
            h.update(obj.raw())
        else:
            self._reduced(h, obj)

    def _items(self, h: Any, items: Any) -> None:
        for item in items:
            self._feed(h, item)
        h.update(b"|")

    def _set(self, h: Any, obj: Any) -> None:
        for part in sorted(_Walker().digest(item) for item in obj):
            h.update(part)

    def _dict(self, h: Any, obj: Any) -> None:
        for key, value in obj.items():
            self._feed(h, key)
            self._feed(h, value)
        h.update(b"|")

    def _function(self, h: Any, func: Any) -> None:
        self._code(h, func.__code__)
        cells = [_cell(c) for c in func.__closure__ or ()]
        attrs = (func.__name__, func.__qualname__, func.__defaults__, func.__kwdefaults__,
                 func.__doc__, func.__dict__, cells)  # fmt: skip
        self._items(h, attrs)

    def _code(self, h: Any, code: types.CodeType) -> None:
        for field in _CODE_FIELDS:
            value = getattr(code, field)
            if isinstance(value, tuple):
                for item in value:
                    self._code(h, item) if isinstance(item, types.CodeType) else self._feed(h, item)
            else:
                self._feed(h, value)

    def _class(self, h: Any, cls: type) -> None:
        self._items(h, (cls.__name__, cls.__qualname__, cls.__bases__, type(cls)))
        for key in sorted(cls.__dict__):
            value = cls.__dict__[key]
            if key not in CLASS_SKIP and not isinstance(value, DESCRIPTORS):
                self._feed(h, key)
                self._feed(h, _unwrap(value))

    def _array(self, h: Any, obj: Any) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            self._items(h, (str(obj.dtype), tuple(obj.shape), obj.requires_grad))
            if obj.is_leaf and obj.grad is not None:
                self._feed(h, obj.grad)
            data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        else:
            self._items(h, (obj.dtype.str, obj.shape))
            if obj.dtype.hasobject:
                self._items(h, obj.ravel(order="K").tolist())
                return
            data = sys.modules["numpy"].ascontiguousarray(obj)
        h.update(memoryview(data).cast("B"))

    def _reduced(self, h: Any, obj: object) -> None:
        reduced = obj.__reduce_ex__(4)
        if isinstance(reduced, str):  # a module global, pickled by reference
            h.update(reduced.encode())
            return
        func, args, *rest = (*reduced, None, None, None)[:5]
        self._feed(h, func)
        self._feed(h, args)
        state, items, dict_items = rest
        self._feed(h, state)
        self._items(h, list(items) if items is not None else ())
        self._items(h, list(dict_items) if dict_items is not None else ())


_SPECIAL: dict[type, Callable[[_Walker, Any, Any], None]] = {
    list: _Walker._items,
    tuple: _Walker._items,
    dict: _Walker._dict,
    set: _Walker._set,
    frozenset: _Walker._set,
}


def _array_like(obj: object) -> bool:
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(obj) is numpy.ndarray:
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _cell(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:
        return "<empty cell>"


def _unwrap(value: object) -> object:
    if isinstance(value, staticmethod | classmethod):
        return (type(value).__name__, value.__func__)
    if isinstance(value, property):
        return ("property", value.fget, value.fset, value.fdel)
    return value
