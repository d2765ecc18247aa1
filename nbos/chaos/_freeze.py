"""A nemesis that freezes a replica (``SIGSTOP``) and thaws it (``SIGCONT``) later."""

from __future__ import annotations

import logging
import random
import signal
from typing import Literal

import attrs

from nbos.chaos._nemesis import Strike, described, executor_of, followers_of
from nbos.chaos._target import EMBEDDED, Capability, ChaosKernel
from nbos.core.errors import ConfigError, KernelError

log = logging.getLogger(__name__)


def _check_hold(instance: FreezeReplica, attribute: object, value: tuple[float, float]) -> None:
    low, high = value
    if not 0 <= low <= high:
        raise ConfigError("hold_s", value, "(low, high) seconds with 0 <= low <= high")


@attrs.frozen
class FreezeReplica:
    """``SIGSTOP`` the executor (``role="executor"``) or a follower for ``hold_s``
    seconds (drawn from that range), then ``SIGCONT`` it.

    A freeze longer than the front's heartbeat limit must be detected: a frozen
    executor's cell is reported lost and must never run afterwards, and the kernel
    gets back to full strength (the thawed replica rejoins or is replaced). A shorter
    one may go unnoticed; then the cell just takes longer.
    """

    role: Literal["executor", "follower"] = "executor"
    hold_s: tuple[float, float] = attrs.field(default=(1.0, 8.0), validator=_check_hold)

    @property
    def needs(self) -> frozenset[Capability]:
        return EMBEDDED

    @property
    def name(self) -> str:
        return f"freeze-{self.role}"

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        executor, view = await executor_of(kernel)
        if self.role == "executor":
            node = executor
        else:
            followers = followers_of(view, executor)
            if not followers:
                raise KernelError(f"kernel {kernel.kernel_id} has no live follower to freeze")
            node = rng.choice(followers)
        hold = round(rng.uniform(*self.hold_s), 3)
        await kernel.signal_replica(node, signal.SIGSTOP)
        return Strike(f"{described([node], executor)} for {hold} s", (node,), lasts_s=hold)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        try:
            await kernel.signal_replica(strike.victims[0], signal.SIGCONT)
        except KernelError as exc:  # replaced meanwhile: the cluster ended the process
            log.info("chaos: replica %d not thawed: %s", strike.victims[0], exc)
