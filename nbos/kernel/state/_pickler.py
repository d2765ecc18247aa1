"""Pickling a user namespace: cell-defined code by value, modules by name.

Functions and classes defined in cells live in ``__main__`` (IPython's user module),
which the other replicas cannot import them from, so they travel by value:

* a function as its marshalled code object plus, set after the function exists so
  that self-reference resolves through the pickle memo, its defaults, closure
  cells, names, annotations, doc and ``__dict__``. Its globals are not shipped: the
  unpickler binds it to the target namespace, where global names are looked up at
  call time exactly as on the executor;
* a class as its name, bases, metaclass and ``__slots__`` (the skeleton), then its
  attributes, so that methods referring to the class (``super()``'s ``__class__``
  cell) resolve through the memo.

Modules are pickled as an import of their name; torch tensors as raw bytes (see
:mod:`._torch`). Everything else uses the standard protocol 5 machinery, whose
``PickleBuffer`` objects the caller can take out of band.
"""

from __future__ import annotations

import abc
import functools
import importlib
import marshal
import pickle
import types
from collections.abc import Callable, MutableMapping
from typing import IO, Any

from nbos.kernel.state import _torch

#: Modules whose functions and classes are pickled by value.
USER_MODULES = frozenset({"__main__"})

# Class attributes that the skeleton recreates, that cannot be set on a new class, or
# that are caches (copyreg adds __slotnames__ the first time an instance is pickled).
CLASS_SKIP = frozenset({"__dict__", "__weakref__", "__slots__", "_abc_impl", "__slotnames__"})
_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


class _EmptyCell:
    """Stands for a closure cell that holds no value yet (pickled by reference)."""


def is_user_defined(obj: object) -> bool:
    """Whether ``obj`` (a function or class) was defined in a cell."""
    return getattr(obj, "__module__", None) in USER_MODULES


class NamespacePickler(pickle.Pickler):
    """A protocol 5 pickler for namespace values (see the module docstring)."""

    def __init__(
        self, file: IO[bytes], buffer_callback: Callable[[pickle.PickleBuffer], Any] | None
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        #: ``id(exporter) -> owner`` for buffers exported by temporaries (a tensor's
        #: numpy view), so a caller can tell which long-lived object owns the memory.
        self.buffer_owners: dict[int, object] = {}

    def reducer_override(self, obj: object) -> Any:
        cls = type(obj)
        if cls is types.FunctionType and is_user_defined(obj):
            return _reduce_function(obj)  # type: ignore[arg-type]
        if isinstance(obj, type) and is_user_defined(obj):
            return _reduce_class(obj)
        if cls is types.ModuleType:
            return importlib.import_module, (obj.__name__,)  # type: ignore[attr-defined]
        if cls in (staticmethod, classmethod):
            return cls, (obj.__func__,)  # type: ignore[attr-defined]
        if cls is property:
            return property, (obj.fget, obj.fset, obj.fdel, obj.__doc__)  # type: ignore[attr-defined]
        if cls.__module__.startswith("torch"):
            return _torch.reduce(obj, self.buffer_owners)
        return NotImplemented


class NamespaceUnpickler(pickle.Unpickler):
    """Unpickles what :class:`NamespacePickler` wrote, binding functions to ``namespace``."""

    def __init__(
        self,
        file: IO[bytes],
        namespace: MutableMapping[str, Any],
        buffers: list[bytearray],
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._namespace = namespace

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _make_function.__name__:
            return functools.partial(_make_function, self._namespace)
        return super().find_class(module, name)


# --- functions -------------------------------------------------------------------


def _reduce_function(func: types.FunctionType) -> tuple[Any, ...]:
    cells = func.__closure__ or ()
    state = {
        "__defaults__": func.__defaults__,
        "__kwdefaults__": func.__kwdefaults__,
        "__annotations__": func.__annotations__,
        "__doc__": func.__doc__,
        "__qualname__": func.__qualname__,
        "__module__": func.__module__,
        "__dict__": func.__dict__,
        "cells": tuple(_cell_value(cell) for cell in cells),
    }
    args = (marshal.dumps(func.__code__), func.__name__, len(cells))
    return _make_function, args, state, None, None, _set_function_state


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an unassigned closure variable
        return _EmptyCell


def _make_function(
    namespace: MutableMapping[str, Any], code: bytes, name: str, ncells: int
) -> types.FunctionType:
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    return types.FunctionType(marshal.loads(code), namespace, name, None, closure)  # type: ignore[arg-type]


def _set_function_state(func: types.FunctionType, state: dict[str, Any]) -> None:
    for cell, value in zip(func.__closure__ or (), state.pop("cells"), strict=True):
        if value is not _EmptyCell:
            cell.cell_contents = value
    func.__dict__.update(state.pop("__dict__"))
    for attr, value in state.items():
        setattr(func, attr, value)


# --- classes ---------------------------------------------------------------------


def _reduce_class(cls: type) -> tuple[Any, ...]:
    slots = cls.__dict__.get("__slots__")
    if isinstance(slots, str):
        slots = (slots,)
    state = {
        key: value
        for key, value in cls.__dict__.items()
        if key not in CLASS_SKIP and not isinstance(value, _DESCRIPTORS)
    }
    state["__qualname__"] = cls.__qualname__
    args = (cls.__name__, cls.__bases__, type(cls), None if slots is None else tuple(slots))
    return _make_class, args, state, None, None, _set_class_state


def _make_class(
    name: str, bases: tuple[type, ...], metaclass: type, slots: tuple[str, ...] | None
) -> type:
    def body(ns: dict[str, Any]) -> None:
        if slots is not None:
            ns["__slots__"] = slots

    return types.new_class(name, bases, {"metaclass": metaclass}, body)


def _set_class_state(cls: type, state: dict[str, Any]) -> None:
    is_abc = isinstance(cls, abc.ABCMeta)
    for attr, value in state.items():
        setattr(cls, attr, value)
    if is_abc:  # abstract methods are computed at class creation, before this state was set
        abc.update_abstractmethods(cls)
