"""Hypothesis strategies for any wire message, with values the wire can carry (64-bit ints)."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of annotation ``tp`` as msgspec encodes them."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is int:
        return INT64
    if tp is float:
        return st.floats(allow_nan=False)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return for_struct(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(for_type(a) for a in args))
    if origin is list:
        return st.lists(for_type(args[0]), max_size=4)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return st.tuples(*(for_type(a) for a in args))
    if origin is dict:
        return st.dictionaries(for_type(args[0]), for_type(args[1]), max_size=4)
    if tp is type(None):
        return st.none()
    return st.from_type(tp)


def for_struct(tp: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(tp)
    fields = {f.name: for_type(hints[f.name]) for f in msgspec.structs.fields(tp)}
    return st.fixed_dictionaries(fields).map(lambda kw: tp(**kw))
