"""Property: ``UserState`` finds the same user state as checking every name, after any
sequence of namespace changes (names bound, rebound, deleted, deleted and bound again
in one cell; IPython's history names)."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

from nbos.kernel.state import UserState
from nbos.kernel.state._names import user_items
from tests.property._support import sized

# User names, IPython's bookkeeping and history names, dunders, and the helpers IPython
# seeds a namespace with (hidden) that a user may rebind.
NAMES = ["a", "_x", "_items", "_", "Out", "_i", "_i7", "_i12", "_3", "__name__", "exit", "open"]
HIDDEN = {"exit": object(), "open": io.open}

changes = st.lists(
    st.tuples(st.sampled_from(NAMES), st.sampled_from(["bind", "hidden", "delete"])),
    max_size=8,
)


def expected(namespace: dict[str, object]) -> dict[str, object]:
    """The definition: every name checked, every time."""
    shown = {k: v for k, v in namespace.items() if k not in HIDDEN or HIDDEN[k] is not v}
    return dict(user_items(shown))


@sized(examples=100)
@given(st.lists(changes, min_size=1, max_size=6))
def test_user_state_is_every_name_checked_every_time(cells: list[list[tuple[str, str]]]) -> None:
    names = UserState()
    namespace: dict[str, object] = dict(HIDDEN)
    for n, cell in enumerate(cells):
        for name, change in cell:
            if change == "delete":
                namespace.pop(name, None)
            else:
                namespace[name] = HIDDEN.get(name, n) if change == "hidden" else [n]
        found = names.of(namespace, HIDDEN)
        assert dict(user_items(found)) == expected(namespace)
