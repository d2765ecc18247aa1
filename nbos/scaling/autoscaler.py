"""When to add hosts and which idle hosts to drain: a deterministic decision over cluster views.

:class:`Autoscaler` is fed a :class:`~nbos.core.placement.ClusterView` at
successive times and answers with a :class:`ScaleOut` (add N hosts), a
:class:`ScaleIn` (drain these hosts) or a :class:`Hold`. It performs no I/O and
reads no clock: the gateway and the simulator call it with their own time. Its
only memory is when it last acted and since when each host has been idle.

The rules (``docs/placement.md``, "Autoscaling"), with *load* = GPUs committed
on any host / GPUs of hosts in service (schedulable, or full: at their replica or
memory limit, their replicas still run cells; draining and suspected hosts are leaving,
so they count as no capacity):

* **Scale out** when there are fewer hosts in service than the floor
  ``max(min_hosts, replicas_per_kernel)``, fewer *spare* hosts (schedulable, no GPU
  committed) than ``spare_hosts`` with those being provisioned, when load >=
  ``scale_out_load``, or when placement failed (a kernel could not be placed or a cell
  found no host). It asks for enough hosts of ``new_host_gpus`` GPUs to bring load down
  to the midpoint between the two thresholds (at least one, and at least the hosts
  missing). A placement failure alone adds nothing while hosts are still being
  provisioned.
* **Scale in** when nothing failed and load < ``scale_in_load``: drain hosts that
  have had no committed GPUs for ``idle_grace`` seconds and hold at most
  ``drain_max_replicas`` replicas (fewest replicas first), as long as each
  removal keeps the floor of hosts in service and ``spare_hosts`` spare hosts, keeps
  load at or below the midpoint, and keeps the subscribed GPUs admissible
  (``subscribed / capacity / replicas_per_kernel <= demand_to_busy_ratio``), so
  the drained hosts' replicas can be placed elsewhere. Moving those replicas is
  the caller's job.
* **Against thrashing**: an action is taken only ``scale_out_cooldown`` (or
  ``scale_in_cooldown``) seconds after the previous action of either kind;
  ``scale_in_load`` must lie below ``scale_out_load`` (hysteresis); a step adds
  or drains at most ``max_step`` hosts; hosts (with those being provisioned)
  stay within ``[min_hosts, max_hosts]``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs

from nbos.core.errors import ConfigError, ScalingError
from nbos.core.ids import HostId
from nbos.core.placement import ClusterView, HostView

log = logging.getLogger(__name__)


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise _refused(ConfigError(attribute.name, value, "an integer >= 1"))


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise _refused(ConfigError(attribute.name, value, "a number >= 0"))


@attrs.frozen
class AutoscalerConfig:
    """Thresholds and limits; :class:`ConfigError` on construction for inconsistent values."""

    min_hosts: int = attrs.field(default=3, validator=_positive_int)
    max_hosts: int = attrs.field(default=64, validator=_positive_int)
    #: Scale out at or above this committed/capacity load.
    scale_out_load: float = 0.9
    #: Consider scaling in only below this load (must be below ``scale_out_load``).
    scale_in_load: float = 0.5
    #: Seconds after the previous action before a scale-out.
    scale_out_cooldown: float = attrs.field(default=120.0, validator=_non_negative)
    #: Seconds after the previous action before a scale-in.
    scale_in_cooldown: float = attrs.field(default=600.0, validator=_non_negative)
    #: Seconds a host must have had no committed GPUs before it may be drained.
    idle_grace: float = attrs.field(default=600.0, validator=_non_negative)
    #: Most hosts added or drained in one decision.
    max_step: int = attrs.field(default=2, validator=_positive_int)
    #: A host holding more replicas than this is not drained (moving them costs).
    drain_max_replicas: int = attrs.field(default=3, validator=_non_negative)
    #: GPUs of a host the autoscaler adds, for sizing a scale-out.
    new_host_gpus: int = attrs.field(default=8, validator=_positive_int)
    #: Hosts kept schedulable with no GPU committed, so that a cell no replica's host can
    #: take migrates to one at once instead of waiting for a host to start.
    spare_hosts: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.spare_hosts > self.max_hosts:
            raise _refused(
                ConfigError("spare_hosts", self.spare_hosts, f"<= max_hosts ({self.max_hosts})")
            )
        if self.max_hosts < self.min_hosts:
            raise _refused(
                ConfigError("max_hosts", self.max_hosts, f">= min_hosts ({self.min_hosts})")
            )
        if not 0 < self.scale_out_load <= 1:
            raise _refused(ConfigError("scale_out_load", self.scale_out_load, "in (0, 1]"))
        if not 0 <= self.scale_in_load < self.scale_out_load:
            raise _refused(
                ConfigError(
                    "scale_in_load",
                    self.scale_in_load,
                    f"in [0, scale_out_load={self.scale_out_load})",
                )
            )

    @property
    def target_load(self) -> float:
        """The load a scale-out aims for and a scale-in must not exceed."""
        return (self.scale_in_load + self.scale_out_load) / 2


@attrs.frozen
class ScaleOut:
    """Provision ``count`` new hosts."""

    count: int
    reason: str


@attrs.frozen
class ScaleIn:
    """Drain these hosts: mark them unschedulable, move their replicas, then remove them."""

    hosts: tuple[HostId, ...]
    reason: str


@attrs.frozen
class Hold:
    """Change nothing now."""

    reason: str


ScaleDecision = ScaleOut | ScaleIn | Hold


@attrs.frozen
class _Load:
    """The figures both directions decide on: the hosts in service (schedulable, or only
    full: ``HostView.in_service``) and their GPUs, GPUs committed and subscribed."""

    in_service: tuple[HostView, ...]
    capacity: int
    committed: int
    subscribed: int

    @property
    def load(self) -> float:
        return _ratio(self.committed, self.capacity)


class Autoscaler:
    """Scale-out and scale-in decisions; one instance per cluster, fed in time order.

    :meth:`decide` remembers the action it returns (for cooldowns) whether or not
    the caller carries it out, so a failed provisioning is not retried before
    the cooldown either.
    """

    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self._config = config if config is not None else AutoscalerConfig()
        self._last_action: float | None = None
        self._last_now: float | None = None
        self._idle_since: dict[HostId, float] = {}

    @property
    def config(self) -> AutoscalerConfig:
        return self._config

    @property
    def last_action_at(self) -> float | None:
        """When the last :class:`ScaleOut` or :class:`ScaleIn` was decided."""
        return self._last_action

    def decide(
        self,
        view: ClusterView,
        now: float,
        placement_failed: bool = False,
        provisioning: int = 0,
    ) -> ScaleDecision:
        """The action to take at ``now`` given ``view``.

        ``provisioning`` counts hosts already asked for but not yet in the view;
        they count towards ``max_hosts`` and the floor. Raises :class:`ScalingError`
        if ``now`` is earlier than a previous call's, the view repeats a host id
        or ``provisioning`` is negative.
        """
        self._check(view, now, provisioning)
        self._track_idle(view, now)
        figures = _figures(view)
        decision = self._scale_out(view, figures, now, placement_failed, provisioning)
        if decision is None:
            decision = self._scale_in(view, figures, now, placement_failed, provisioning)
        if not isinstance(decision, Hold):
            self._last_action = now
            log.info("autoscaler at t=%.1f: %s", now, decision)
        return decision

    # --- scale-out ---------------------------------------------------------------

    def _scale_out(
        self,
        view: ClusterView,
        figures: _Load,
        now: float,
        placement_failed: bool,
        provisioning: int,
    ) -> ScaleDecision | None:
        """A decision if scale-out is called for (possibly a Hold for a limit), else None."""
        cfg = self._config
        hosts = len(figures.in_service) + provisioning
        below_floor = max(0, self._floor(view) - hosts)
        # A pass over the hosts only when spares are asked for: the simulator asks every tick.
        spare_short = (
            max(0, cfg.spare_hosts - _spare(figures.in_service) - provisioning)
            if cfg.spare_hosts
            else 0
        )
        # Hosts being provisioned will bring capacity; count them so as not to ask twice.
        capacity = figures.capacity + provisioning * cfg.new_host_gpus
        load = _ratio(figures.committed, capacity)
        if not (below_floor or spare_short or placement_failed or load >= cfg.scale_out_load):
            return None
        reason = _out_reason(below_floor, spare_short, placement_failed, load, cfg.scale_out_load)
        if not (below_floor or spare_short) and load < cfg.scale_out_load and provisioning:
            # Only placement failed, and hosts are on their way: wait for them rather
            # than adding one more per cooldown while a slow provider boots them.
            return Hold(f"{reason}, {provisioning} hosts already provisioning")
        waited = self._since_last(now)
        if waited < cfg.scale_out_cooldown:
            return Hold(
                f"{reason}, but cooling down ({waited:.0f}s of {cfg.scale_out_cooldown:g}s)"
            )
        needed = math.ceil(figures.committed / cfg.target_load) - capacity
        by_load = max(0, math.ceil(needed / cfg.new_host_gpus))
        room = cfg.max_hosts - len(view.hosts) - provisioning
        count = min(max(below_floor, spare_short, by_load, 1), cfg.max_step, room)
        if count <= 0 and not (below_floor or placement_failed or load >= cfg.scale_out_load):
            return None  # only spares short, at the ceiling: a scale-in may make room
        if count <= 0:
            return Hold(f"{reason}, but at max_hosts={cfg.max_hosts}")
        return ScaleOut(count, reason)

    # --- scale-in ----------------------------------------------------------------

    def _scale_in(
        self,
        view: ClusterView,
        figures: _Load,
        now: float,
        placement_failed: bool,
        provisioning: int,
    ) -> ScaleDecision:
        cfg = self._config
        if placement_failed or provisioning or figures.load >= cfg.scale_in_load:
            return Hold(f"load {figures.load:.2f} (scale out at {cfg.scale_out_load:g})")
        waited = self._since_last(now)
        if waited < cfg.scale_in_cooldown:
            return Hold(f"low load, but cooling down ({waited:.0f}s of {cfg.scale_in_cooldown:g}s)")
        chosen = self._drainable(view, figures, now)
        if not chosen:
            return Hold(f"load {figures.load:.2f}, but no host can be drained")
        return ScaleIn(chosen, f"load {figures.load:.2f} < {cfg.scale_in_load:g}")

    def _drainable(self, view: ClusterView, figures: _Load, now: float) -> tuple[HostId, ...]:
        cfg = self._config
        idle = sorted(
            (
                h
                for h in figures.in_service
                if h.gpus_committed == 0
                and h.replicas <= cfg.drain_max_replicas
                and now - self._idle_since.get(h.host_id, now) >= cfg.idle_grace
            ),
            key=lambda h: (h.replicas, h.gpus_subscribed, h.host_id),
        )
        chosen: list[HostId] = []
        remaining, capacity = len(figures.in_service), figures.capacity
        spare = _spare(figures.in_service)
        for h in idle:
            if len(chosen) == cfg.max_step or remaining - 1 < self._floor(view):
                break
            if h.schedulable and spare - 1 < cfg.spare_hosts:
                continue
            after = capacity - h.gpus_total
            fits_load = _ratio(figures.committed, after) <= cfg.target_load
            fits_subs = (
                _ratio(figures.subscribed, after) / view.replicas_per_kernel
                <= view.demand_to_busy_ratio
            )
            if fits_load and fits_subs:
                chosen.append(h.host_id)
                remaining, capacity = remaining - 1, after
                spare -= h.schedulable
        return tuple(chosen)

    # --- bookkeeping -------------------------------------------------------------

    def _floor(self, view: ClusterView) -> int:
        return min(max(self._config.min_hosts, view.replicas_per_kernel), self._config.max_hosts)

    def _since_last(self, now: float) -> float:
        return math.inf if self._last_action is None else now - self._last_action

    def _track_idle(self, view: ClusterView, now: float) -> None:
        present = {h.host_id for h in view.hosts}
        for gone in [h for h in self._idle_since if h not in present]:
            del self._idle_since[gone]
        for h in view.hosts:
            if h.gpus_committed > 0:
                self._idle_since.pop(h.host_id, None)
            else:
                self._idle_since.setdefault(h.host_id, now)

    def _check(self, view: ClusterView, now: float, provisioning: int) -> None:
        problem = None
        if not math.isfinite(now) or (self._last_now is not None and now < self._last_now):
            problem = f"autoscaler time went from {self._last_now} to {now}"
        elif provisioning < 0:
            problem = f"autoscaler told {provisioning} hosts are provisioning"
        elif len({h.host_id for h in view.hosts}) != len(view.hosts):
            problem = f"cluster view repeats host ids: {sorted(h.host_id for h in view.hosts)}"
        if problem is not None:
            log.warning("%s", problem)
            raise ScalingError(problem)
        self._last_now = now


#: Weight of each new sample in :func:`smoothed_demand_ratio`.
RATIO_ALPHA = 0.2


def smoothed_demand_ratio(
    previous: float, demanded: int, busy: int, alpha: float = RATIO_ALPHA
) -> float:
    """The next ``ClusterView.demand_to_busy_ratio`` after a change in the cluster.

    An exponential moving average, updated on every change, of GPUs demanded (each
    placed kernel's GPU count once) over GPUs committed, with the sample floored at
    1 and ``busy`` counted as at least 1: the more subscribed GPUs sit idle, the
    further admission lets hosts be oversubscribed, and the scale-in check lets
    hosts go. The simulator uses it; the gateway's scheduler computes the same.
    """
    sample = max(1.0, demanded / max(busy, 1))
    return previous + alpha * (sample - previous)


def _figures(view: ClusterView) -> _Load:
    # One pass: the simulator asks this every tick of a month-long trace.
    # A full host serves the cluster (its replicas run cells on its GPUs): counting it as
    # missing from the floor had a full cluster scale out "below the minimum".
    in_service: list[HostView] = []
    capacity = committed = subscribed = 0
    for h in view.hosts:
        committed += h.gpus_committed
        subscribed += h.gpus_subscribed
        if h.in_service:
            in_service.append(h)
            capacity += h.gpus_total
    return _Load(tuple(in_service), capacity, committed, subscribed)


def _ratio(part: int, whole: int) -> float:
    if whole > 0:
        return part / whole
    return 0.0 if part <= 0 else math.inf


def _spare(in_service: tuple[HostView, ...]) -> int:
    """Hosts a migrating replica could go to with every GPU idle."""
    return sum(1 for h in in_service if h.schedulable and h.gpus_committed == 0)


def _out_reason(
    below_floor: int, spare_short: int, placement_failed: bool, load: float, threshold: float
) -> str:
    if below_floor:
        return f"{below_floor} hosts below the minimum"
    if spare_short:
        return f"{spare_short} spare hosts short"
    if placement_failed:
        return "placement failed"
    return f"load {load:.2f} >= {threshold:g}"


def _refused(error: ConfigError) -> ConfigError:
    log.warning("autoscaler config refused: %s", error)
    return error
