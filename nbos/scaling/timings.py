"""How long nbos's own work takes: the durations the simulator assumes, measured live.

A :class:`Timings` holds four durations in seconds: a host's start (a scale-out until the
new host takes replicas), a replica's migration (a learner started on the target, caught
up, voting), a cell's GPU commit (the pre-commit and commit on its host's agent) and a
kernel's start (its replicas up and a leader elected). ``nbos calibrate`` measures them on
the live cluster and writes them as a TOML file of those four keys::

    host_startup = 10.8
    migration_time = 2.1
    gpu_commit = 0.028
    kernel_start = 1.8

which ``nbos simulate --timings FILE`` and ``nbos replay --simulate --timings FILE`` read
(:func:`load_timings`: unknown keys and bad values are refused with a
:class:`~nbos.core.errors.ConfigError`). Without a file the simulator assumes
:data:`MEASURED`, this project's development machine's figures.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import attrs

from nbos.core.config import read_toml
from nbos.core.errors import ConfigError

log = logging.getLogger(__name__)


def _seconds(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refused(ConfigError(attribute.name, value, "a number of seconds >= 0"))
    if not (math.isfinite(value) and value >= 0):
        raise _refused(ConfigError(attribute.name, value, "a number of seconds >= 0"))


@attrs.frozen(kw_only=True)
class Timings:
    """Seconds nbos's own work takes; :class:`ConfigError` for a negative or non-finite one."""

    #: From a scale-out decision until the new host takes replicas.
    host_startup: float = attrs.field(validator=_seconds)
    #: A replica's move to another host, which a cell that caused it waits for.
    migration_time: float = attrs.field(validator=_seconds)
    #: A cell's GPUs pre-committed and committed on its host, before it runs.
    gpu_commit: float = attrs.field(validator=_seconds)
    #: A kernel's start, from its placement until it runs a cell.
    kernel_start: float = attrs.field(validator=_seconds)

    def scaled(self, factor: float) -> Timings:
        """Each duration ``factor`` times as long: on a replay ``factor`` times faster than its
        trace, nbos's own work takes that many trace seconds per real one."""
        return Timings(**{k: v * factor for k, v in attrs.asdict(self).items()})

    def as_toml(self, comment: str = "") -> str:
        """The TOML text :func:`load_timings` reads back (``comment`` as leading lines)."""
        lines = [f"# {line}" for line in comment.splitlines()]
        lines += [f"{key} = {value!r}" for key, value in attrs.asdict(self).items()]
        return "\n".join(lines) + "\n"


#: Measured with ``nbos calibrate --samples 5`` on the project's 2-core development machine,
#: shared with other work (local agents; medians, rounded): ``docs/simulator.md``,
#: "Calibration".
MEASURED = Timings(host_startup=10.8, migration_time=2.1, gpu_commit=0.028, kernel_start=1.8)


def load_timings(path: str | Path) -> Timings:
    """The :class:`Timings` of a TOML file; :class:`ConfigError` for an unreadable file, a
    missing or unknown key, or a bad value."""
    raw = read_toml(Path(path))
    fields = {f.name for f in attrs.fields(Timings)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise _refused(ConfigError(f"{path}: {unknown[0]}", raw[unknown[0]], "a known setting"))
    missing = sorted(fields - set(raw))
    if missing:
        raise _refused(ConfigError(f"{path}: {missing[0]}", None, "a value (it is required)"))
    try:
        return Timings(**raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.key}", exc.value, exc.expected) from None


def _refused(error: ConfigError) -> ConfigError:
    log.warning("simulator timings refused: %s", error)
    return error
