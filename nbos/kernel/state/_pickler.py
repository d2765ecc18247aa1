"""Pickling a user namespace: cell-defined code by value, modules by name.

Functions and classes defined in cells live in ``__main__`` (IPython's user module),
which the other replicas cannot import them from, so they travel by value:

* a function as its marshalled code object plus, set after the function exists so
  that self-reference resolves through the pickle memo, its defaults, closure
  cells, names, annotations, doc and ``__dict__``. Its globals are not shipped: the
  unpickler binds it to the target namespace, where global names are looked up at
  call time exactly as on the executor;
* a class as its name, bases (as written, so ``Generic[T]`` works), metaclass and
  ``__slots__`` (the skeleton), then its attributes, so that methods referring to
  the class (``super()``'s ``__class__`` cell) resolve through the memo. Enums are
  rebuilt through their functional API, since members exist only from creation.

Functions and classes that are not importable where they claim to live (the
internals of a ``namedtuple``, closures made by library code) also go by value; such
a function carries the globals its code names. Modules are pickled as an import of
their name (and refused if not importable by it); dataclasses' sentinels by
reference; mappingproxies, ``TypeVar``s and ``lru_cache`` wrappers from cells by
what rebuilds them; torch tensors as raw bytes (see :mod:`._torch`). Everything else
uses the standard protocol 5 machinery, whose ``PickleBuffer`` objects the caller
can take out of band.

Unpickling runs code named by the pickle: only entries from the kernel's own
replicas (its Raft log) may be applied. All replicas must run the same Python
minor version, since code objects travel marshalled.
"""

from __future__ import annotations

import abc
import enum
import functools
import importlib
import marshal
import pickle
import sys
import types
import typing
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from typing import IO, Any

from nbos.kernel.state import _torch

#: Modules whose functions and classes are pickled by value.
USER_MODULES = frozenset({"__main__"})

# Class attributes that the skeleton recreates, that cannot be set on a new class, or
# that are caches (copyreg adds __slotnames__ the first time an instance is pickled).
CLASS_SKIP = frozenset(
    {"__dict__", "__weakref__", "__slots__", "_abc_impl", "__slotnames__", "__orig_bases__"}
)
DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


class _EmptyCell:
    """Stands for a closure cell that holds no value yet (pickled by reference)."""


# Module-level sentinels compared with `is` (dataclasses' generated __init__ does):
# pickled by reference, or a replica would get look-alikes that compare unequal.
_SENTINELS = {
    "dataclasses": ("MISSING", "KW_ONLY", "_HAS_DEFAULT_FACTORY", "_FIELD", "_FIELD_CLASSVAR",
                    "_FIELD_INITVAR", "_EMPTY_METADATA"),
}  # fmt: skip


def is_user_defined(obj: object) -> bool:
    """Whether ``obj`` (a function or class) was defined in a cell."""
    return getattr(obj, "__module__", None) in USER_MODULES


def by_value(obj: types.FunctionType | type) -> bool:
    """Whether a function or class is pickled by value: defined in a cell, or not
    importable under its module and qualified name (``namedtuple`` internals, closures
    made by library code)."""
    module = getattr(obj, "__module__", None)
    if module in USER_MODULES:
        return True
    target: Any = sys.modules.get(module) if isinstance(module, str) else None
    for part in obj.__qualname__.split("."):
        target = getattr(target, part, None)
    return target is not obj


class NamespacePickler(pickle.Pickler):
    """A protocol 5 pickler for namespace values (see the module docstring)."""

    def __init__(
        self, file: IO[bytes], buffer_callback: Callable[[pickle.PickleBuffer], Any] | None
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        #: ``id(exporter) -> owner`` for buffers exported by temporaries (a tensor's
        #: numpy view), so a caller can tell which long-lived object owns the memory.
        self.buffer_owners: dict[int, object] = {}
        self._sentinels = {
            id(getattr(sys.modules[module], name)): (sys.modules[module], name)
            for module, names in _SENTINELS.items()
            if module in sys.modules
            for name in names
            if hasattr(sys.modules[module], name)
        }

    def reducer_override(self, obj: object) -> Any:
        cls = type(obj)
        if cls is types.FunctionType and by_value(obj):  # type: ignore[arg-type]
            return _reduce_function(obj)  # type: ignore[arg-type]
        if isinstance(obj, type) and by_value(obj):
            return _reduce_class(obj)
        if cls is types.ModuleType:
            return _reduce_module(obj)  # type: ignore[arg-type]
        if id(obj) in self._sentinels:
            return getattr, self._sentinels[id(obj)]
        if cls is types.MappingProxyType:
            return types.MappingProxyType, (dict(obj),)  # type: ignore[call-overload]
        if cls is typing.TypeVar and is_user_defined(obj):
            return _reduce_typevar(obj)  # type: ignore[arg-type]
        if cls is functools._lru_cache_wrapper:
            wrapped = obj.__wrapped__  # type: ignore[attr-defined]
            params = obj.cache_parameters()  # type: ignore[attr-defined]
            return _make_lru_cache, (wrapped, params["maxsize"], params["typed"])
        if cls in (staticmethod, classmethod):
            return cls, (obj.__func__,)  # type: ignore[attr-defined]
        if cls is property:
            return property, (obj.fget, obj.fset, obj.fdel, obj.__doc__)  # type: ignore[attr-defined]
        if cls.__module__.startswith("torch"):
            return _torch.reduce(obj, self.buffer_owners)
        if cls.__module__ == "numpy" and cls.__name__ == "ndarray":
            return _reduce_array_view(obj)
        return NotImplemented


class NamespaceUnpickler(pickle.Unpickler):
    """Unpickles what :class:`NamespacePickler` wrote, binding functions to ``namespace``."""

    def __init__(
        self,
        file: IO[bytes],
        namespace: MutableMapping[str, Any],
        buffers: Sequence[bytearray | memoryview],
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._namespace = namespace

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _make_function.__name__:
            return functools.partial(_make_function, self._namespace)
        if module in USER_MODULES:
            # Cell-defined objects travel by value; a reference into __main__ would
            # resolve against whatever that module holds in this process, if anything.
            raise pickle.UnpicklingError(f"{module}.{name} was pickled by reference")
        return super().find_class(module, name)


def _reduce_module(module: types.ModuleType) -> tuple[Any, ...]:
    if sys.modules.get(module.__name__) is not module:
        raise pickle.PicklingError(f"module {module.__name__!r} is not importable by name")
    return importlib.import_module, (module.__name__,)


def _reduce_array_view(array: Any) -> Any:
    """A view of a numpy array that owns its memory, as that array plus where it looks.

    numpy pickles a view as a copy; rebuilding it over its base keeps the two sharing
    memory on the replica, as they do here (a write through either shows in both).
    """
    numpy = sys.modules["numpy"]
    root = array.base
    while isinstance(root, numpy.ndarray) and root.base is not None:
        root = root.base
    if not (
        type(root) is numpy.ndarray
        and root.base is None
        and (root.flags.c_contiguous or root.flags.f_contiguous)
        and not root.dtype.hasobject
    ):
        return NotImplemented
    offset = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    layout = (array.shape, array.dtype, offset, array.strides, bool(array.flags.writeable))
    return _make_array_view, (root, layout)


def _make_array_view(root: Any, layout: tuple[Any, ...]) -> Any:
    shape, dtype, offset, strides, writeable = layout
    view = type(root)(shape, dtype, buffer=root, offset=offset, strides=strides)
    view.flags.writeable = writeable and bool(root.flags.writeable)
    return view


def _reduce_typevar(var: typing.TypeVar) -> tuple[Any, ...]:
    variance = (var.__covariant__, var.__contravariant__)
    return _make_typevar, (var.__name__, var.__constraints__, var.__bound__, variance)


def _make_typevar(
    name: str, constraints: tuple[Any, ...], bound: Any, variance: tuple[bool, bool]
) -> Any:
    covariant, contravariant = variance
    var = typing.TypeVar(  # type: ignore[misc]
        name, *constraints, bound=bound, covariant=covariant, contravariant=contravariant
    )
    var.__module__ = "__main__"
    return var


def _make_lru_cache(func: Callable[..., Any], maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(func)


# --- functions -------------------------------------------------------------------


def _reduce_function(func: types.FunctionType) -> tuple[Any, ...]:
    cells = func.__closure__ or ()
    # A cell's function reads globals from the namespace it is applied to; any other
    # function pickled by value carries the globals its code names.
    own_globals = None if is_user_defined(func) else _globals_used(func)
    state = {
        "__defaults__": func.__defaults__,
        "__kwdefaults__": func.__kwdefaults__,
        "__annotations__": func.__annotations__,
        "__doc__": func.__doc__,
        "__qualname__": func.__qualname__,
        "__module__": func.__module__,
        "__dict__": func.__dict__,
        "cells": tuple(_cell_value(cell) for cell in cells),
        "globals": own_globals,
    }
    args = (_marshalled(func.__code__), func.__name__, len(cells), own_globals is not None)
    return _make_function, args, state, None, None, _set_function_state


# marshal's output for one code object varies with the reference counts of its
# constants; an unchanged function must pickle to the same bytes every capture. Keyed
# by identity: equal code objects may differ in what equality ignores (co_qualname).
_MARSHALLED: dict[int, tuple[weakref.ref[types.CodeType], bytes]] = {}


def _marshalled(code: types.CodeType) -> bytes:
    known = _MARSHALLED.get(id(code))
    if known is not None and known[0]() is code:
        return known[1]
    key = id(code)
    data = marshal.dumps(code)
    _MARSHALLED[key] = (weakref.ref(code, lambda _: _MARSHALLED.pop(key, None)), data)
    return data


def _globals_used(func: types.FunctionType) -> dict[str, Any]:
    names: set[str] = set()
    codes = [func.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    found = {n: func.__globals__[n] for n in names if n in func.__globals__}
    found["__name__"] = func.__globals__.get("__name__")
    return found


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an unassigned closure variable
        return _EmptyCell


def _make_function(
    namespace: MutableMapping[str, Any], code: bytes, name: str, ncells: int, own_globals: bool
) -> types.FunctionType:
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    scope = {} if own_globals else namespace
    return types.FunctionType(marshal.loads(code), scope, name, None, closure)  # type: ignore[arg-type]


def _set_function_state(func: types.FunctionType, state: dict[str, Any]) -> None:
    own_globals = state.pop("globals")
    if own_globals is not None:
        func.__globals__.update(own_globals)
    for cell, value in zip(func.__closure__ or (), state.pop("cells"), strict=True):
        if value is not _EmptyCell:
            cell.cell_contents = value
    func.__dict__.update(state.pop("__dict__"))
    for attr, value in state.items():
        setattr(func, attr, value)


# --- classes ---------------------------------------------------------------------


def _reduce_class(cls: type) -> tuple[Any, ...]:
    if isinstance(cls, enum.EnumMeta):
        return _reduce_enum(cls)
    slots = cls.__dict__.get("__slots__")
    if isinstance(slots, str):
        slots = (slots,)
    state = {
        key: value
        for key, value in cls.__dict__.items()
        if key not in CLASS_SKIP and not isinstance(value, DESCRIPTORS)
    }
    state["__qualname__"] = cls.__qualname__
    # The bases as written (``Generic[T]``, ``TypedDict``) rebuild what __bases__ cannot;
    # typing.NamedTuple is the exception: its class is a plain namedtuple underneath.
    bases = cls.__dict__.get("__orig_bases__", cls.__bases__)
    if typing.NamedTuple in bases:
        bases = cls.__bases__
    skeleton: dict[str, Any] = {"__module__": cls.__module__}
    if slots is not None:
        skeleton["__slots__"] = tuple(slots)
    args = (cls.__name__, bases, type(cls), skeleton)
    return _make_class, args, state, None, None, _set_class_state


def _make_class(
    name: str, bases: tuple[Any, ...], metaclass: type, skeleton: dict[str, Any]
) -> type:
    def body(ns: dict[str, Any]) -> None:
        ns.update(skeleton)

    return types.new_class(name, bases, {"metaclass": metaclass}, body)


def _reduce_enum(cls: enum.EnumMeta) -> tuple[Any, ...]:
    # EnumMeta builds members at class creation, so the class is made by the functional
    # API from (name, value) pairs; methods and properties are set after, as for classes.
    listed: dict[str, Any] = dict(cls.__members__)
    members = [(name, member._value_) for name, member in listed.items()]
    *mixins, base = cls.__bases__
    behaviour = (types.FunctionType, staticmethod, classmethod, property)
    state = {
        key: value
        for key, value in cls.__dict__.items()
        if key not in cls.__members__ and (isinstance(value, behaviour) or key == "__doc__")
    }
    state["__qualname__"] = cls.__qualname__
    args = (base, cls.__name__, members, mixins[0] if mixins else None, cls.__module__)
    return _make_enum, args, state, None, None, _set_class_state


def _make_enum(
    base: Any, name: str, members: list[tuple[str, Any]], mixin: type | None, module: str
) -> type:
    made: type = base(name, members, module=module, type=mixin)
    return made


def _set_class_state(cls: type, state: dict[str, Any]) -> None:
    is_abc = isinstance(cls, abc.ABCMeta)
    for attr, value in state.items():
        setattr(cls, attr, value)
    if is_abc:  # abstract methods are computed at class creation, before this state was set
        abc.update_abstractmethods(cls)
