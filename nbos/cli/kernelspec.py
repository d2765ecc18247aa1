"""``nbos kernelspec install``: make the ``nbos`` kernel known to Jupyter."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nbos.jupyter import install


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("kernelspec", help="manage the nbos Jupyter kernelspec")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    inst = actions.add_parser("install", help="install the nbos kernelspec")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for the current user only")
    where.add_argument("--prefix", help="under this prefix (e.g. sys.prefix of a venv)")
    inst.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="the kernel's default GPUs per cell (N > 0 installs it as nbos-gpu-N)",
    )
    inst.add_argument(
        "--cluster",
        metavar="FILE",
        help="its kernels run on the gateway of this cluster file (nbos cluster up FILE)",
    )
    inst.set_defaults(func=install_command)


def install_command(args: argparse.Namespace) -> int:
    cluster = None
    if args.cluster is not None:
        from nbos.deploy import load_cluster_file

        load_cluster_file(args.cluster)  # a bad file is refused now, not at each kernel start
        cluster = str(Path(args.cluster).resolve())
    path = install(user=args.user, prefix=args.prefix, gpus=args.gpus, cluster=cluster)
    print(f"installed the nbos kernelspec in {path}")
    return 0
