"""No healthy kernel dead: kernels beside the one under test keep running, with their state.

A fault of the control plane (a stopped gateway, a flood of starts, a bad request) can
destroy kernels it never touched. Each bystander kernel holds a list ``B``; after
every fault it is probed: it must still be listed by the gateway, run a cell (which
appends the next number to ``B``) and hold every append it acknowledged, exactly once.
"""

from __future__ import annotations

import json

import anyio
import attrs

from nbos.chaos._checks import Violation, check_appends
from nbos.chaos._target import ChaosKernel
from nbos.core.errors import KernelError, UnknownKernelError

_SETUP = "import json\nB = []"
#: Between failed probe cells of a kernel that may be recovering: not a busy loop.
_RETRY_S = 1.0


@attrs.define
class Bystander:
    """A kernel the run started beside the one under test, and the appends it acknowledged."""

    kernel: ChaosKernel
    acknowledged: list[int] = attrs.field(factory=list)
    _next: int = 1

    async def setup(self, timeout: float) -> None:
        """Define ``B``; :class:`KernelError` if that cell fails."""
        result = await self.kernel.execute(_SETUP, timeout=timeout)
        if result.status != "ok":
            raise KernelError(f"bystander kernel {self.kernel.kernel_id}: {result.error}")

    async def probe(self, *, cell_timeout: float, within: float) -> list[Violation]:
        """Listed, runs a cell within ``within`` seconds (retried while it fails), and
        holds every acknowledged append once; the violations if not."""
        deadline = anyio.current_time() + within
        while True:
            failure = await self._attempt(cell_timeout)
            if not isinstance(failure, str):
                return failure
            if anyio.current_time() >= deadline:
                return [Violation("kernel-dead", failure)]
            await anyio.sleep(_RETRY_S)

    async def _attempt(self, cell_timeout: float) -> list[Violation] | str:
        """The violations found (a final answer), or why this attempt failed."""
        name = self.kernel.kernel_id
        try:
            view = await self.kernel.view()
        except UnknownKernelError:
            return [Violation("kernel-dead", f"kernel {name} is no longer listed by the gateway")]
        except KernelError as exc:
            return f"kernel {name}: {exc}"
        value = self._next
        self._next += 1
        code = f"B.append({value})\nprint(json.dumps(B))"
        try:
            result = await self.kernel.execute(code, timeout=cell_timeout)
        except TimeoutError:
            return f"kernel {name} answered no cell in {cell_timeout:g} s (alive: {view.alive})"
        if result.status != "ok":
            return f"kernel {name} failed a cell: {result.error} (alive: {view.alive})"
        self.acknowledged.append(value)
        return check_appends(name, self.acknowledged, json.loads(result.stdout))


async def listed(kernel: ChaosKernel) -> list[Violation]:
    """The kernel under test is still listed (its cells and state are checked elsewhere)."""
    try:
        await kernel.view()
    except UnknownKernelError:
        return [Violation("kernel-dead", f"kernel {kernel.kernel_id} is no longer listed")]
    except KernelError as exc:
        return [Violation("kernel-dead", f"kernel {kernel.kernel_id}: {exc}")]
    return []
