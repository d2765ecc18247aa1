"""``nbos run NOTEBOOK``: the main job, a notebook on a replicated kernel on the local cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio
import nbformat

from nbos.cluster import ExecuteResult, LocalCluster
from nbos.core.config import Settings
from nbos.core.errors import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a notebook on a replicated kernel on the embedded local cluster",
        description="Run every code cell of NOTEBOOK on a 3-replica kernel; print, per cell, "
        "the replica that ran it, its wait before start and its duration.",
    )
    parser.add_argument("notebook", type=Path)
    parser.add_argument("-o", "--output", type=Path, help="write the executed notebook here")
    parser.add_argument("--hosts", type=int, help="virtual hosts (default: config, 3)")
    parser.add_argument(
        "--allow-errors", action="store_true", help="go on after a cell that raised"
    )
    parser.add_argument(
        "--kill-executor-after",
        type=int,
        action="append",
        default=[],
        metavar="CELL",
        help="SIGKILL the replica that ran cell number CELL once it finished, to watch the "
        "next cell run on another replica with the same state (repeatable)",
    )
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings = Settings.load(args.config)
    try:
        notebook = nbformat.read(args.notebook, as_version=4)
    except (OSError, ValueError) as exc:
        raise ConfigError("notebook", str(args.notebook), f"a readable notebook ({exc})") from exc
    hosts = args.hosts or settings.cluster.hosts
    failed = anyio.run(
        _run_notebook, notebook, hosts, settings, args.allow_errors, set(args.kill_executor_after)
    )
    if args.output:
        nbformat.write(notebook, args.output)
        print(f"wrote {args.output}")
    return 1 if failed else 0


async def _run_notebook(
    notebook: Any, hosts: int, settings: Settings, allow_errors: bool, kill_after: set[int]
) -> bool:
    async with LocalCluster(hosts=hosts, settings=settings) as cluster:
        kernel = await cluster.start_kernel()
        placed = ", ".join(f"replica {r.node} on {r.host}" for r in kernel.replicas)
        print(f"kernel {kernel.kernel_id}: {placed}")
        print(f"{'cell':>4}  {'replica':>7}  {'wait':>9}  {'run':>9}  status")
        for number, cell in enumerate(notebook.cells, start=1):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            result = await kernel.execute(cell.source)
            _record(cell, result)
            print(_line(number, result))
            if result.status != "ok" and not allow_errors:
                ename, evalue = result.error or ("error", "")
                print(f"stopped at cell {number}: {ename}: {evalue}", file=sys.stderr)
                return True
            if number in kill_after and result.executor is not None:
                await kernel.kill_replica(result.executor)
                print(f"      killed replica {result.executor} (SIGKILL)")
        await kernel.shutdown()
    return False


def _record(cell: Any, result: ExecuteResult) -> None:
    cell.execution_count = result.execution_count
    cell.outputs = [
        nbformat.v4.output_from_msg(
            {"header": {"msg_type": o["msg_type"]}, "content": o["content"]}
        )
        for o in result.outputs
        if o["msg_type"] in ("stream", "display_data", "execute_result", "error")
    ]


def _line(number: int, result: ExecuteResult) -> str:
    replica = "-" if result.executor is None else str(result.executor)
    return (
        f"{number:>4}  {replica:>7}  {_ms(result.wait_s):>9}  {_ms(result.run_s):>9}  "
        f"{result.status}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
