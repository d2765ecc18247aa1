"""``nbos swarm deploy|rm FILE``: nbos as a Docker Swarm stack."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "swarm",
        help="deploy or remove nbos as a Docker Swarm stack (gateway, agents, Redis)",
        description="deploy: make the stack of a swarm file (its [swarm] table and nbos "
        "settings) and run docker stack deploy with it: Redis and the gateway on the node "
        "labelled nbos.gateway=true, an agent on every node labelled nbos.gpu=true, host "
        "networking, keys as Docker secrets. rm: docker stack rm. The docker CLI reaches a "
        "manager of the swarm ($DOCKER_HOST). See docs/deploy.md, 'Docker Swarm'.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    deploy = actions.add_parser("deploy", help="deploy (or update) the stack")
    deploy.add_argument("file", metavar="FILE", help="the swarm file (TOML)")
    deploy.add_argument(
        "--output",
        metavar="DIR",
        type=Path,
        help="write the stack (DIR/stack.yml, for docker stack deploy -c) and the settings "
        "file it names to DIR instead of deploying",
    )
    deploy.set_defaults(func=deploy_command)
    rm = actions.add_parser("rm", help="remove the stack, its configs and its secrets")
    rm.add_argument("file", metavar="FILE", help="the swarm file (TOML)")
    rm.set_defaults(func=rm_command)


def deploy_command(args: argparse.Namespace) -> int:
    from nbos.deploy import gateway_node_ip, load_swarm_file, swarm_deploy, write_stack

    if args.output is not None:
        swarm_file = load_swarm_file(args.file)
        print(write_stack(swarm_file, gateway_node_ip(), args.output))
        return 0
    print(f"deployed: stack {swarm_deploy(args.file)}")
    return 0


def rm_command(args: argparse.Namespace) -> int:
    from nbos.deploy import swarm_rm

    print(f"removed: stack {swarm_rm(args.file)}")
    return 0
