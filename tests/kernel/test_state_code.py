"""Functions and classes defined in cells travel by value and run on the replica."""

from __future__ import annotations

import abc
import dataclasses

import pytest

from tests.kernel.conftest import Pair, sent_names

pytestmark = pytest.mark.anyio


async def test_functions_keep_defaults_closures_and_attributes(pair: Pair) -> None:
    await pair.cell(
        """
        def fact(n: int) -> int:
            "factorial"
            return 1 if n < 2 else n * fact(n - 1)

        def make(k):
            later = None
            def add(x, y=2, *, z=3):
                return x + y + z + k
            def uses_later():
                return later
            return add, uses_later

        add, uses_later = make(100)
        fact.tag = "t"
        def kw(*, a=[1]): return a
        square = lambda v: v * v
        """
    )
    r = pair.replica
    assert r["fact"](5) == 120
    assert r["fact"].__doc__ == "factorial" and r["fact"].__annotations__ == {
        "n": int,
        "return": int,
    }
    assert r["fact"].tag == "t"
    assert r["add"](1) == 106 and r["add"](1, 1, z=1) == 103
    assert r["uses_later"]() is None
    assert r["kw"]() == [1] and r["square"](7) == 49
    assert r["make"].__qualname__ == "make" and r["add"].__qualname__ == "make.<locals>.add"


async def test_functions_bind_to_the_replica_namespace(pair: Pair) -> None:
    await pair.cell("scale = 2\ndef f(x): return x * scale")
    assert pair.replica["f"].__globals__ is pair.replica
    await pair.cell("scale = 3")
    assert pair.replica["f"](2) == 6


async def test_unassigned_closure_cell_stays_empty(pair: Pair) -> None:
    await pair.cell(
        """
        def outer():
            def inner():
                return late
            g = inner
            late = 1
            del late
            return g
        g = outer()
        """
    )
    with pytest.raises(NameError):
        pair.replica["g"]()


async def test_classes_and_their_instances(pair: Pair) -> None:
    await pair.cell(
        """
        class Base:
            def __init__(self, v):
                self.v = v
            def describe(self):
                return f"{type(self).__name__}({self.v})"

        class Point(Base):
            "a point"
            count = 0
            def __init__(self, v):
                super().__init__(v)
                Point.count += 1
            def clone(self):
                return Point(self.v)
            @staticmethod
            def origin():
                return Point(0)
            @classmethod
            def named(cls):
                return cls.__name__
            @property
            def double(self):
                return 2 * self.v

        p = Point(4)
        q = p.clone()
        """
    )
    r = pair.replica
    assert isinstance(r["p"], r["Point"]) and isinstance(r["p"], r["Base"])
    assert r["p"].describe() == "Point(4)" and r["p"].double == 8
    assert r["Point"].origin().v == 0 and r["Point"].named() == "Point"
    assert r["Point"].__doc__ == "a point" and r["Point"].__module__ == "__main__"
    assert type(r["p"]) is type(r["q"]) is r["Point"]
    assert r["p"].clone().v == 4  # global lookup of Point in the replica namespace


async def test_slots_abc_and_nested_classes(pair: Pair) -> None:
    await pair.cell(
        """
        import abc
        class Slotted:
            __slots__ = ("a", "b")
            def __init__(self):
                self.a, self.b = 1, 2
        s = Slotted()

        class Shape(abc.ABC):
            @abc.abstractmethod
            def area(self): ...
        class Square(Shape):
            def area(self):
                return 4

        class Outer:
            class Inner:
                pass
        inner = Outer.Inner()
        """
    )
    r = pair.replica
    assert (r["s"].a, r["s"].b) == (1, 2) and not hasattr(r["s"], "__dict__")
    assert isinstance(r["Shape"], abc.ABCMeta) and r["Square"]().area() == 4
    with pytest.raises(TypeError):
        r["Shape"]()
    assert r["Outer"].Inner.__qualname__ == "Outer.Inner"


async def test_redefined_function_is_sent_again(pair: Pair) -> None:
    await pair.cell("def f(): return 1")
    delta = await pair.cell("def f(): return 2")
    assert await sent_names(delta, pair.store) == {"f"}
    assert pair.replica["f"]() == 2
    delta = await pair.cell("f.__defaults__ = None\nf.marker = 1")
    assert await sent_names(delta, pair.store) == {"f"}
    assert pair.replica["f"].marker == 1


async def test_dataclasses_keep_their_generated_behaviour(pair: Pair) -> None:
    await pair.cell(
        """
        import dataclasses
        @dataclasses.dataclass
        class D:
            x: int = 1
            y: list = dataclasses.field(default_factory=list)
        @dataclasses.dataclass(frozen=True, order=True)
        class F:
            v: int
        d = D(2)
        f = F(3)
        """
    )
    r = pair.replica
    fresh = r["D"]()
    assert fresh.y == [] and fresh.x == 1  # the default-factory sentinel is the real one
    assert r["d"] == r["D"](2) and dataclasses.replace(r["d"], x=5).x == 5
    assert r["F"](1) < r["f"] and [fl.name for fl in dataclasses.fields(r["F"])] == ["v"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r["f"].v = 9


async def test_enums_keep_member_identity_and_methods(pair: Pair) -> None:
    await pair.cell(
        """
        import enum
        class Base(enum.Enum):
            def label(self):
                return self.name.lower()
        class Color(Base):
            RED = 1
            CRIMSON = 1
            BLUE = 2
            @property
            def warm(self):
                return self is Color.RED
        class Perm(enum.Flag):
            R = enum.auto()
            W = enum.auto()
        class Level(enum.IntEnum):
            LOW = 1
        favourite = Color.RED
        rw = Perm.R | Perm.W
        """
    )
    r = pair.replica
    assert r["favourite"] is r["Color"].RED is r["Color"].CRIMSON
    assert r["favourite"].warm and r["Color"].BLUE.label() == "blue"
    assert list(r["Color"]) == [r["Color"].RED, r["Color"].BLUE]
    assert r["Perm"].W in r["rw"] and r["Level"].LOW == 1


async def test_tuples_typed_dicts_generics_and_caches(pair: Pair) -> None:
    await pair.cell(
        """
        import collections, functools, typing
        P = collections.namedtuple("P", "x y")
        class Q(typing.NamedTuple):
            a: int
            b: str = "b"
        class TD(typing.TypedDict):
            k: int
        T = typing.TypeVar("T")
        class Box(typing.Generic[T]):
            def __init__(self, item: T):
                self.item = item
        @functools.lru_cache(maxsize=None)
        def fib(n):
            return n if n < 2 else fib(n - 1) + fib(n - 2)
        def add(a, b):
            return a + b
        inc = functools.partial(add, 1)
        p, q, box = P(1, 2), Q(1), Box[int](5)
        td = TD(k=1)
        getter = box.__init__
        """
    )
    r = pair.replica
    assert r["p"]._replace(x=9) == r["P"](9, 2) and r["q"] == r["Q"](1, "b")
    assert r["TD"].__required_keys__ == frozenset({"k"}) and r["td"] == {"k": 1}
    assert r["Box"][int](3).item == 3 and r["T"].__name__ == "T"
    assert r["fib"](30) == 832040 and r["fib"].cache_info().hits > 0
    assert r["inc"](2) == 3 and r["getter"].__self__ is r["box"]


async def test_an_unchanged_function_is_not_sent_again(pair: Pair) -> None:
    await pair.cell("def f():\n    return (1.5, 'abc def', (2.5, 3.5))")
    keep = list(pair.executor["f"].__code__.co_consts)  # changes what marshal writes
    delta = await pair.cell("x = 1")
    assert await sent_names(delta, pair.store) == {"x"} and keep


async def test_equal_code_under_another_qualified_name_keeps_its_own(pair: Pair) -> None:
    # same source lines in two cells: code objects equal whatever their co_qualname
    await pair.cell("class A:\n    def me(self):\n        return 1")
    await pair.cell("class B:\n    def me(self):\n        return 1")
    assert pair.executor["A"].me.__code__ == pair.executor["B"].me.__code__
    assert pair.replica["A"].me.__code__.co_qualname == "A.me"
    assert pair.replica["B"].me.__code__.co_qualname == "B.me"
