"""``nbos simulate``: replay a session trace in nbos mode and/or the reservation baseline."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nbos.cli._progress import progress_bar
from nbos.core.errors import ConfigError, ScalingError
from nbos.scaling.autoscaler import AutoscalerConfig
from nbos.scaling.fair_share import FairShare
from nbos.scaling.results import SimResult, metrics_table, users_table
from nbos.scaling.simulator import MODES, SimConfig, simulate
from nbos.scaling.timings import MEASURED, Timings, load_timings
from nbos.scaling.trace import Trace, first_hours, load_trace, synthetic_trace, with_users

Progress = Callable[[float], None]

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``simulate`` subcommand; its handler is set as ``func``."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a notebook session trace against the scheduling policies",
        description=(
            "Replay a session trace (a file, or a synthetic one) on a simulated cluster, "
            "in nbos mode (replicated kernels, GPUs bound per cell) and/or the reservation "
            "baseline (GPUs held for a session's life), and print the metrics side by side."
        ),
    )
    add_trace_arguments(p)
    p.add_argument("--policy", default="least-loaded", help="placement policy name")
    p.add_argument(
        "--policy-arg",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="keyword argument for the policy (VALUE as JSON, else a string); repeatable",
    )
    p.add_argument("--hosts", type=int, default=4, help="hosts at the start (4)")
    p.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (8)")
    p.add_argument("--mode", choices=[*MODES, "both"], default="both", help="(both)")
    p.add_argument("--no-autoscale", action="store_true", help="keep the cluster at --hosts")
    p.add_argument("--max-hosts", type=int, default=64, help="autoscaler ceiling (64)")
    add_spare_hosts_argument(p)
    p.add_argument(
        "--precopy",
        action="store_true",
        help="nbos mode: copy replicas of idle kernels ahead of their next cell",
    )
    add_timings_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per mode")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="draw GPUs and hosts over time and the delay CDF into FILE (needs nbos[plot])",
    )
    p.set_defaults(func=run)


def add_spare_hosts_argument(p: argparse.ArgumentParser, scope: str = "autoscaler") -> None:
    """``--spare-hosts``: read by :func:`autoscaler_config`; ``scope`` says whose."""
    p.add_argument(
        "--spare-hosts",
        type=int,
        default=0,
        metavar="N",
        help=f"{scope}: keep N hosts with every GPU idle, for cells to migrate to at once (0)",
    )


def autoscaler_config(args: argparse.Namespace) -> AutoscalerConfig | None:
    """The autoscaler ``--no-autoscale``, ``--max-hosts``, ``--spare-hosts`` and
    ``--gpus-per-host`` describe (:class:`ConfigError` for bad values), ``None`` without."""
    if args.no_autoscale:
        if args.spare_hosts:
            raise ConfigError("--spare-hosts", args.spare_hosts, "without --no-autoscale")
        return None
    try:
        return AutoscalerConfig(
            min_hosts=min(AutoscalerConfig().min_hosts, args.max_hosts),
            max_hosts=args.max_hosts,
            new_host_gpus=args.gpus_per_host,
            spare_hosts=args.spare_hosts,
        )
    except ConfigError as exc:
        flag = _AUTOSCALER_FLAGS.get(exc.key, exc.key)
        raise ConfigError(flag, exc.value, exc.expected) from exc


#: The option that sets each autoscaler field :func:`autoscaler_config` fills.
_AUTOSCALER_FLAGS = {
    "min_hosts": "--max-hosts",
    "max_hosts": "--max-hosts",
    "new_host_gpus": "--gpus-per-host",
    "spare_hosts": "--spare-hosts",
}


def add_timings_argument(p: argparse.ArgumentParser) -> None:
    """``--timings``: read by :func:`timings`."""
    p.add_argument(
        "--timings",
        metavar="FILE",
        help="the durations of nbos's own work as nbos calibrate wrote them "
        "(default: this project's development machine's)",
    )


def timings(args: argparse.Namespace) -> Timings:
    """The :class:`Timings` ``--timings`` names (:class:`ConfigError` for a bad file), else
    :data:`~nbos.scaling.timings.MEASURED`."""
    return MEASURED if args.timings is None else load_timings(args.timings)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """TRACE, ``--trace``, ``--synthetic``, ``--hours``, ``--seed``, ``--session-users``: read
    by :func:`load`; ``--quota`` and ``--default-quota``: read by :func:`fair_share`."""
    p.add_argument(
        "trace_file",
        nargs="?",
        metavar="TRACE",
        help="a trace file: nbos .json or .csv, or a task-level .csv (found by its header)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="the same as TRACE")
    source.add_argument(
        "--synthetic",
        metavar="N",
        type=int,
        default=59,
        help="without a trace file: a synthetic trace of N sessions (default: 59)",
    )
    p.add_argument(
        "--hours",
        type=float,
        help="synthetic trace length (48); with a trace file, replay only its first HOURS",
    )
    p.add_argument("--seed", type=int, default=0, help="synthetic trace seed (0)")
    p.add_argument(
        "--session-users",
        metavar="FILE",
        help="a JSON object mapping session ids to users (sessions not named, and every "
        "session of a trace without a user column, are users of their own)",
    )
    p.add_argument(
        "--quota",
        metavar="USER=GPUS",
        action="append",
        default=[],
        help="a user's guaranteed GPUs (repeatable); with quotas, cells wait by fair share",
    )
    p.add_argument(
        "--default-quota",
        metavar="GPUS",
        type=int,
        help="the quota of users without --quota (0 once any --quota is given)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the simulation(s) ``args`` describe and print the results."""
    trace = load(args)
    modes = MODES if args.mode == "both" else (args.mode,)
    autoscaler = autoscaler_config(args)
    kwargs = _policy_kwargs(args.policy_arg)
    quotas = fair_share(args)
    durations = timings(args)
    results = []
    for mode in modes:
        config = SimConfig(
            hosts=args.hosts,
            gpus_per_host=args.gpus_per_host,
            mode=mode,
            policy=args.policy,
            policy_kwargs=kwargs,
            autoscaler=autoscaler,
            fair_share=quotas,
            precopy=args.precopy and mode == "nbos",
        ).timed(durations)
        with _progress_bar(mode, trace) as progress:
            results.append(simulate(trace, config, progress=progress))
    per_user = trace.names_users or quotas is not None
    show(results, args, f"its ceiling of {args.max_hosts} hosts (--max-hosts)", per_user)
    return 0


def show(
    results: list[SimResult], args: argparse.Namespace, ceiling: str, per_user: bool = False
) -> None:
    """Print ``results`` as a table (or JSON with ``--json``), with a table per user of each
    if ``per_user``, draw them with ``--plot``, and warn of each column whose work waited
    while the autoscaler sat at ``ceiling``."""
    if args.plot:
        from nbos.scaling.plot import plot_results

        plot_results(results, args.plot)
    if args.json:
        for r in results:
            print(json.dumps(r.summary()))
    else:
        print(metrics_table(results))
        for r in results if per_user else ():
            print()
            print(users_table(r))
    for r in results:
        if r.hours_at_ceiling:
            print(
                f"warning: {r.mode}: work waited {r.hours_at_ceiling:.1f} h while the autoscaler "
                f"was at {ceiling}",
                file=sys.stderr,
            )


def load(args: argparse.Namespace) -> Trace:
    """The trace :func:`add_trace_arguments`' arguments name."""
    if args.trace_file and args.trace:
        raise ConfigError("--trace", args.trace, "not given together with a TRACE argument")
    path = args.trace_file or args.trace
    if path is None:
        hours = 48.0 if args.hours is None else args.hours
        trace = synthetic_trace(args.synthetic, hours, args.seed)
    else:
        trace = load_trace(path)
        trace = trace if args.hours is None else first_hours(trace, args.hours)
    if args.session_users is None:
        return trace
    try:
        return with_users(trace, _session_users(args.session_users))
    except ScalingError as exc:
        raise ConfigError("--session-users", args.session_users, str(exc)) from exc


def _session_users(path: str) -> dict[str, str]:
    try:
        mapping = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("cannot read --session-users %s: %s", path, exc)
        raise ConfigError("--session-users", path, f"a readable JSON file ({exc})") from exc
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        log.warning("bad --session-users %s", path)
        raise ConfigError("--session-users", path, 'a JSON object {"session": "user", ...}')
    return mapping


def fair_share(args: argparse.Namespace) -> FairShare | None:
    """The quotas ``--quota`` and ``--default-quota`` give, or ``None`` for neither."""
    if not args.quota and args.default_quota is None:
        return None
    quotas: dict[str, int] = {}
    for pair in args.quota:
        user, sep, text = pair.partition("=")
        if not sep or not user or user in quotas or not text.strip().isdigit():
            log.warning("bad --quota %r", pair)
            raise ConfigError("--quota", pair, "USER=GPUS, each user once, GPUS an integer >= 0")
        quotas[user] = int(text)
    return FairShare(quotas, 0 if args.default_quota is None else args.default_quota)


@contextlib.contextmanager
def _progress_bar(mode: str, trace: Trace) -> Iterator[Progress | None]:
    """A bar of simulated hours on a terminal, else nothing."""
    total = max(1, round(trace.end / 3600))
    with progress_bar(total, f"simulating {mode}", "h") as bar:
        if bar is None:
            yield None
            return

        def progress(now: float) -> None:
            hours = min(total, int(now // 3600))
            if hours > bar.n:
                bar.update(hours - bar.n)

        yield progress


def _policy_kwargs(pairs: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            log.warning("bad --policy-arg %r", pair)
            raise ConfigError("--policy-arg", pair, "KEY=VALUE with KEY a Python identifier")
        try:
            kwargs[key] = json.loads(text)
        except json.JSONDecodeError:
            kwargs[key] = text
    return kwargs
