"""The apply side in a real separate Python process, which never saw the cells' source."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbos.kernel.state import namespace_digest
from tests.kernel.conftest import Pair, replay_in_child

pytestmark = pytest.mark.anyio


async def test_code_values_and_sharing_are_rebuilt_in_another_process(
    pair: Pair, tmp_path: Path
) -> None:
    await pair.cell(
        """
        import numpy as np
        import math
        from collections import OrderedDict

        def fib(n):
            return n if n < 2 else fib(n - 1) + fib(n - 2)

        class Account:
            rate = 0.5
            def __init__(self, owner, balance):
                self.owner, self.balance = owner, balance
            def grow(self):
                return Account(self.owner, self.balance * (1 + self.rate))
            def __repr__(self):
                return f"Account({self.owner!r}, {self.balance})"

        acct = Account("ann", 10)
        shared = [1, 2]
        holder = {"a": shared, "b": shared}
        big = np.arange(300_000, dtype=np.float64)
        tags = {"x", "y", "z"}
        od = OrderedDict(k=1)
        """
    )
    await pair.cell("shared.append(3)\nacct.balance = 20\nbig[7] = -1\nscale = math.sqrt(16)")
    report = replay_in_child(
        pair,
        """
        result = {
            "fib": fib(10),
            "grown": repr(acct.grow()),
            "is_account": isinstance(acct.grow(), Account),
            "shared": holder["a"] is holder["b"] is shared,
            "big7": float(big[7]),
            "sum": float(big.sum()),
            "scale": scale,
            "writeable": bool(big.flags.writeable),
        }
        """,
        tmp_path,
    )
    assert report["digest"] == namespace_digest(pair.executor)
    assert report["probe"] == {
        "fib": 55,
        "grown": "Account('ann', 30.0)",
        "is_account": True,
        "shared": True,
        "big7": -1.0,
        "sum": float(pair.executor["big"].sum()),
        "scale": 4.0,
        "writeable": True,
    }


async def test_digest_is_the_same_in_another_process(pair: Pair, tmp_path: Path) -> None:
    # sets of strings iterate in a per-process order; the digest must not depend on it
    await pair.cell("words = {'alpha', 'beta', 'gamma', 'delta'}\nnested = [words, {'k': words}]")
    report = replay_in_child(pair, "result = sorted(words)", tmp_path)
    assert report["digest"] == namespace_digest(pair.executor)
    assert report["probe"] == ["alpha", "beta", "delta", "gamma"]
